"""What a start computes once for a model folder, computed ahead: ``make model``, ``ci/test.sh`` and the image build
run ``python -m handler.engine.prepare <folder>``, so the embedded model's first start reads both from the start
cache (``handler.start_cache``) like every later one: the int8 model (``model.packed``) and the tokenizer class
transformers picks (``core.tokenizer``). Prints what it wrote."""

from __future__ import annotations

import sys
from pathlib import Path

from handler.engine.core.tokenizer import load_tokenizer, record_path
from handler.engine.model import packed


def prepare(model_dir: Path) -> list[Path]:
    load_tokenizer(model_dir)
    return [packed.prepare(model_dir), record_path(model_dir)]


if __name__ == "__main__":
    for path in prepare(Path(sys.argv[1])):
        print(path)
