"""handler.images.resolve: name lookups that end at the caller's deadline, on a bounded set of shared threads.

The resolver that never answers is the lookup hook ``Resolver`` runs (``NeverAnswers``: it blocks until the test
ends, as a dead nameserver or a hung NSS module would block ``getaddrinfo``). Nothing leaves the machine: no lookup
reaches a real resolver, and no fetch gets as far as a connection.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from handler.images import DecodeLimits, FetchFailure, FetchPolicy, ImageFetchError, Resolver, fetch_image_bytes
from handler.images.loader import ImageLoader, LoadBudget


class NeverAnswers:
    """A lookup that blocks until ``release`` is set (the test's end), then fails; records the hosts it was given."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.hosts: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, host: str, port: int) -> list[tuple[object, ...]]:
        with self._lock:
            self.hosts.append(host)
        self.release.wait()
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")


@pytest.fixture()
def never() -> Iterator[NeverAnswers]:
    lookup = NeverAnswers()
    yield lookup
    lookup.release.set()  # the stuck lookup threads end with the test


def wait_until(condition, limit_s: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``limit_s`` passes (False); a wait, not a measurement."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@dataclass(frozen=True)
class Ref:
    ref: str
    param: str


def ask_at_once(resolver: Resolver, hosts: list[str], timeout: float) -> list[BaseException | None]:
    """Each host asked on its own thread, all at once; what each call raised (None: it answered)."""
    outcomes: list[BaseException | None] = [None] * len(hosts)

    def ask(index: int) -> None:
        try:
            resolver.resolve(hosts[index], 80, timeout)
        except Exception as error:
            outcomes[index] = error

    askers = [threading.Thread(target=ask, args=(index,)) for index in range(len(hosts))]
    for thread in askers:
        thread.start()
    for thread in askers:
        thread.join()
    return outcomes


def test_a_resolver_that_never_answers_ends_the_fetch_at_its_deadline_and_frees_its_slot(never: NeverAnswers) -> None:
    resolver = Resolver(never, threads=1)
    loader = ImageLoader(FetchPolicy(), DecodeLimits(), LoadBudget(fetch_budget_s=0.3, fetch_concurrency=2),
                         fetch=functools.partial(fetch_image_bytes, resolver=resolver))
    refs = [Ref(f"http://host{i}.test/cat.png", f"messages[0].content[{i}]") for i in range(3)]
    with pytest.raises(ImageFetchError) as error, loader.load(refs):
        pass
    assert error.value.reason is FetchFailure.BUDGET
    assert "image fetch budget of 0.3 s (option.image_fetch_budget)" in error.value.message
    assert wait_until(lambda: loader.fetch_slots.used == 0)  # both lanes gave their slots back
    # one lookup thread, stuck on the first host; the second host's lookup was dropped unstarted, the third never asked
    assert never.hosts == ["host0.test"]
    assert (resolver.num_threads, resolver.num_queued) == (1, 0)


def test_stuck_lookups_hold_no_more_than_the_threads_allowed(never: NeverAnswers) -> None:
    resolver = Resolver(never, threads=3)
    outcomes = ask_at_once(resolver, [f"h{i}.test" for i in range(12)], 0.2)
    assert all(isinstance(outcome, TimeoutError) for outcome in outcomes)
    assert "did not answer within 0.2 s" in str(outcomes[0])
    assert resolver.num_threads == 3 and len(never.hosts) == 3
    assert resolver.num_queued == 0  # the nine never started are gone


def test_the_same_host_asked_at_once_is_looked_up_once(never: NeverAnswers) -> None:
    resolver = Resolver(never, threads=4)
    outcomes = ask_at_once(resolver, ["same.test"] * 5, 0.2)
    assert all(isinstance(outcome, TimeoutError) for outcome in outcomes)
    assert never.hosts == ["same.test"]


def test_answers_and_errors_reach_every_caller() -> None:
    answers = {"ok.test": [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", 80))]}

    def lookup(host: str, port: int) -> list[tuple[object, ...]]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answers[host]

    resolver = Resolver(lookup, threads=2)
    assert resolver.resolve("ok.test", 80, 5) == answers["ok.test"]
    with pytest.raises(socket.gaierror, match="Name or service not known"):
        resolver.resolve("nowhere.test", 80, 5)


def test_a_lookup_frees_its_thread_for_the_next_once_answered() -> None:
    gate = threading.Event()

    def lookup(host: str, port: int) -> list[tuple[object, ...]]:
        if host == "slow.test":
            gate.wait()
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port))]

    resolver = Resolver(lookup, threads=1)
    with pytest.raises(TimeoutError):
        resolver.resolve("slow.test", 80, 0.1)
    gate.set()  # the slow answer comes after its caller left: the thread takes the next lookup
    assert resolver.resolve("fast.test", 8080, 5)[0][4] == ("93.184.215.14", 8080)
    assert resolver.num_threads == 1


@pytest.mark.parametrize(("policy", "reason", "words"), [
    (FetchPolicy(timeout_s=0.2), FetchFailure.DNS, "the name resolver did not answer within 0.2 s"),
    (FetchPolicy(timeout_s=5, total_timeout_s=0.2), FetchFailure.TIMEOUT, "total time limit of 0.2s exceeded"),
])
def test_the_fetchs_own_limits_bound_the_lookup(never: NeverAnswers, policy: FetchPolicy, reason: FetchFailure,
                                                words: str) -> None:
    with pytest.raises(ImageFetchError) as error:
        fetch_image_bytes("http://stuck.test/x.png", policy, param="img", resolver=Resolver(never, threads=1))
    assert error.value.reason is reason and error.value.param == "img"
    assert error.value.message == f"could not resolve image URL host 'stuck.test': {words}"
