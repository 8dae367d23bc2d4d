"""Short questions with known answers: what ``bench.quality`` asks each numeric scheme, greedy, to read the answers
users read rather than averages over text.

Each entry is ``(question, answers, distractors)``. An answer is right when, in the normalised text (``normalise``:
lower case, punctuation to spaces, number words to digits), one of ``answers`` occurs as whole words before any of
``distractors`` does: "A whale is a mammal, not a fish" is right for mammal-or-fish, "A fish, not a mammal" is
wrong. Four kinds, about 30 each: facts, arithmetic, units, one-word classifications. Written for this benchmark;
the embedded 135M model gets about half of them right in fp32, which is what matters here: whether another numeric
scheme gets the same ones right.
"""

from __future__ import annotations

import re

Question = tuple[str, tuple[str, ...], tuple[str, ...]]

FACTS: list[Question] = [
    ("What is the capital of France?", ("paris",), ()),
    ("What is the capital of Japan?", ("tokyo",), ()),
    ("What is the capital of Italy?", ("rome",), ()),
    ("What is the capital of Germany?", ("berlin",), ()),
    ("What is the capital of Spain?", ("madrid",), ()),
    ("What is the capital of the United Kingdom?", ("london",), ()),
    ("What is the capital of Russia?", ("moscow",), ()),
    ("What is the capital of China?", ("beijing",), ()),
    ("What is the capital of Egypt?", ("cairo",), ()),
    ("What is the capital of Canada?", ("ottawa",), ("toronto", "montreal", "vancouver")),
    ("What is the capital of Australia?", ("canberra",), ("sydney", "melbourne")),
    ("What is the largest planet in our solar system?", ("jupiter",), ("saturn", "earth")),
    ("Which planet is closest to the Sun?", ("mercury",), ("venus", "mars")),
    ("Which planet is known as the Red Planet?", ("mars",), ("venus", "jupiter")),
    ("What is the chemical symbol for gold?", ("au",), ("ag", "go")),
    ("What is the chemical symbol for water?", ("h2o",), ()),
    ("What gas do plants absorb from the air for photosynthesis?", ("carbon dioxide", "co2"), ("oxygen",)),
    ("What is the largest ocean on Earth?", ("pacific",), ("atlantic", "indian")),
    ("What is the longest river in Africa?", ("nile",), ("congo", "niger")),
    ("Who wrote Romeo and Juliet?", ("shakespeare",), ()),
    ("Who painted the Mona Lisa?", ("leonardo", "da vinci"), ("michelangelo", "raphael")),
    ("What is the freezing point of water in degrees Celsius?", ("0",), ("32", "100")),
    ("What is the boiling point of water in degrees Celsius?", ("100",), ("212", "0")),
    ("How many continents are there?", ("7",), ("5", "6")),
    ("How many legs does a spider have?", ("8",), ("6", "4")),
    ("How many legs does an insect have?", ("6",), ("8", "4")),
    ("What is the hardest natural substance?", ("diamond",), ()),
    ("What is the tallest mountain in the world?", ("everest",), ("k2",)),
    ("In which country are the pyramids of Giza?", ("egypt",), ()),
    ("What language is mainly spoken in Brazil?", ("portuguese",), ("spanish",)),
    ("What is the largest mammal?", ("blue whale",), ("elephant",)),
    ("What star is at the centre of our solar system?", ("sun",), ()),
]

ARITHMETIC: list[Question] = [
    ("What is 2 + 2?", ("4",), ()),
    ("What is 3 + 5?", ("8",), ()),
    ("What is 7 + 6?", ("13",), ()),
    ("What is 10 + 15?", ("25",), ()),
    ("What is 9 - 4?", ("5",), ()),
    ("What is 20 - 7?", ("13",), ()),
    ("What is 100 - 1?", ("99",), ()),
    ("What is 3 times 4?", ("12",), ()),
    ("What is 5 times 5?", ("25",), ()),
    ("What is 6 times 7?", ("42",), ()),
    ("What is 8 times 8?", ("64",), ()),
    ("What is 9 times 3?", ("27",), ()),
    ("What is 10 times 10?", ("100",), ()),
    ("What is 12 divided by 3?", ("4",), ()),
    ("What is 20 divided by 4?", ("5",), ()),
    ("What is 100 divided by 10?", ("10",), ()),
    ("What is half of 50?", ("25",), ()),
    ("What is double 12?", ("24",), ()),
    ("What is 15 + 15?", ("30",), ()),
    ("What is 11 + 22?", ("33",), ()),
    ("What is 50 + 50?", ("100",), ()),
    ("What is 1000 - 1?", ("999",), ()),
    ("What is the square root of 9?", ("3",), ()),
    ("What is the square root of 16?", ("4",), ()),
    ("What is 2 to the power of 3?", ("8",), ()),
    ("What is 7 - 7?", ("0",), ()),
    ("What is 4 + 4 + 4?", ("12",), ()),
    ("What is 25 + 25?", ("50",), ()),
    ("What is 30 divided by 2?", ("15",), ()),
    ("What is 2 times 9?", ("18",), ()),
]

UNITS: list[Question] = [
    ("How many centimetres are in a metre?", ("100",), ()),
    ("How many millimetres are in a centimetre?", ("10",), ()),
    ("How many metres are in a kilometre?", ("1000", "1 000"), ()),
    ("How many grams are in a kilogram?", ("1000", "1 000"), ()),
    ("How many millilitres are in a litre?", ("1000", "1 000"), ()),
    ("How many seconds are in a minute?", ("60",), ()),
    ("How many minutes are in an hour?", ("60",), ()),
    ("How many hours are in a day?", ("24",), ()),
    ("How many days are in a week?", ("7",), ()),
    ("How many months are in a year?", ("12",), ()),
    ("How many days are in a leap year?", ("366",), ("365",)),
    ("How many days are in a normal year?", ("365",), ("366",)),
    ("How many weeks are in a year?", ("52",), ()),
    ("How many years are in a century?", ("100",), ()),
    ("How many years are in a decade?", ("10",), ()),
    ("How many inches are in a foot?", ("12",), ()),
    ("How many feet are in a yard?", ("3",), ()),
    ("How many ounces are in a pound?", ("16",), ()),
    ("How many sides does a triangle have?", ("3",), ()),
    ("How many sides does a hexagon have?", ("6",), ()),
    ("How many sides does a square have?", ("4",), ()),
    ("How many degrees are in a right angle?", ("90",), ()),
    ("How many degrees are in a full circle?", ("360",), ()),
    ("How many cents are in a dollar?", ("100",), ()),
    ("How many players are on a soccer team on the field?", ("11",), ()),
    ("How many bytes are in a kilobyte?", ("1024", "1000", "1 000"), ()),
    ("How many bits are in a byte?", ("8",), ()),
    ("How many zeros are in one million?", ("6",), ()),
    ("How many hours are in two days?", ("48",), ()),
    ("How many minutes are in two hours?", ("120",), ()),
]

CLASSIFICATION: list[Question] = [
    ("Is a whale a mammal or a fish? Answer with one word.", ("mammal",), ("fish",)),
    ("Is a shark a mammal or a fish? Answer with one word.", ("fish",), ("mammal",)),
    ("Is a tomato a fruit or a vegetable? Answer with one word.", ("fruit",), ("vegetable",)),
    ("Is a carrot a fruit or a vegetable? Answer with one word.", ("vegetable",), ("fruit",)),
    ("Is 7 an even or an odd number? Answer with one word.", ("odd",), ("even",)),
    ("Is 10 an even or an odd number? Answer with one word.", ("even",), ("odd",)),
    ("Is ice a solid, a liquid or a gas? Answer with one word.", ("solid",), ("liquid", "gas")),
    ("Is steam a solid, a liquid or a gas? Answer with one word.", ("gas",), ("solid", "liquid")),
    ("Is water at room temperature a solid, a liquid or a gas? Answer with one word.", ("liquid",),
     ("solid", "gas")),
    ("Is the sentiment of 'I love this movie, it was wonderful' positive or negative? Answer with one word.",
     ("positive",), ("negative",)),
    ("Is the sentiment of 'This was the worst meal I have ever had' positive or negative? Answer with one word.",
     ("negative",), ("positive",)),
    ("Is the sentiment of 'What a fantastic day, I am so happy' positive or negative? Answer with one word.",
     ("positive",), ("negative",)),
    ("Is the sentiment of 'I hate waiting in long lines' positive or negative? Answer with one word.",
     ("negative",), ("positive",)),
    ("Is the Sun a star or a planet? Answer with one word.", ("star",), ("planet",)),
    ("Is Mars a star or a planet? Answer with one word.", ("planet",), ("star",)),
    ("Is a penguin a bird or a mammal? Answer with one word.", ("bird",), ("mammal",)),
    ("Is a bat a bird or a mammal? Answer with one word.", ("mammal",), ("bird",)),
    ("Is a frog an amphibian or a reptile? Answer with one word.", ("amphibian",), ("reptile",)),
    ("Is a snake an amphibian or a reptile? Answer with one word.", ("reptile",), ("amphibian",)),
    ("Is gold a metal or a gas? Answer with one word.", ("metal",), ("gas",)),
    ("Is oxygen a metal or a gas? Answer with one word.", ("gas",), ("metal",)),
    ("Is an apple a fruit or a vegetable? Answer with one word.", ("fruit",), ("vegetable",)),
    ("Is the word 'run' a noun or a verb? Answer with one word.", ("verb",), ("noun",)),
    ("Is the word 'table' a noun or a verb? Answer with one word.", ("noun",), ("verb",)),
    ("Is fire hot or cold? Answer with one word.", ("hot",), ("cold",)),
    ("Is snow hot or cold? Answer with one word.", ("cold",), ("hot",)),
    ("Is the Pacific an ocean or a lake? Answer with one word.", ("ocean",), ("lake",)),
    ("Is Python a programming language or a database? Answer with one word.", ("programming", "language"),
     ("database",)),
    ("Is a rose a flower or a tree? Answer with one word.", ("flower",), ("tree",)),
    ("Is an oak a flower or a tree? Answer with one word.", ("tree",), ("flower",)),
]

QUESTIONS: list[Question] = FACTS + ARITHMETIC + UNITS + CLASSIFICATION

NUMBER_WORDS = {"zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
                "seven": "7", "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12",
                "thirteen": "13", "fifteen": "15", "sixteen": "16", "eighteen": "18", "twenty": "20",
                "hundred": "100", "thousand": "1000"}


def normalise(text: str) -> str:
    """Lower case, thousands separators dropped (``1,000`` -> ``1000``), punctuation to spaces, number words to
    digits, single spaces, padded with a space on each side so that whole words match as `` word ``."""
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.lower())
    text = re.sub(r"(?<=\d)\.0+\b", "", text)  # 100.0 -> 100
    words = re.sub(r"[^a-z0-9]+", " ", text).split()
    return " " + " ".join(NUMBER_WORDS.get(word, word) for word in words) + " "


def first_index(text: str, phrases: tuple[str, ...]) -> int | None:
    """Where the first of ``phrases`` occurs as whole words in normalised ``text``, or None."""
    found = [text.find(f" {normalise(phrase).strip()} ") for phrase in phrases]
    found = [index for index in found if index >= 0]
    return min(found) if found else None


def is_right(answer: str, question: Question) -> bool:
    """One of the question's answers occurs before any of its distractors (``normalise``d, whole words)."""
    _text, answers, distractors = question
    text = normalise(answer)
    right = first_index(text, answers)
    if right is None:
        return False
    wrong = first_index(text, distractors)
    return wrong is None or right < wrong
