"""Where the settings come from, and in which order: ``load_settings`` builds ``config.Settings`` from them once
at start and raises ``ConfigError`` naming the key and the reason.

Precedence, highest first (LMI's rules, so LMI users can move over):
- ``HF_MODEL_ID`` for ``option.model_id``; ``OPTION_FOO_BAR=x`` for ``option.foo_bar`` (the part after ``OPTION_``
  is lower-cased only when it is all upper case, so ``OPTION_entryPoint`` keeps its case; ``_`` never becomes ``.``);
- every other environment name (TGI's, SageMaker's, ours for the process) when ours are unset: ``config.ENV_NAMES``,
  the one table of them (nothing else in the server reads an environment name for a setting; the process's own
  knobs, ``LLM_*``, which kernels run and where the start caches live, are ``handler.knobs.KNOBS``);
- the properties file: ``$SERVING_PROPERTIES``, else ``serving.properties`` in the model directory, else the one
  shipped at the repository root.
The model: ``option.model_id`` when set (a local folder, a Hub id ``org/name`` or an ``s3://`` prefix, the last two
downloaded at start by ``handler.download``), else the SageMaker model directory ``/opt/ml/model`` when it holds a
model, else the embedded default in ``model_store/``. LMI's vLLM handler named as ``option.entryPoint`` picks the
engine (``apply_lmi_entry_point``), and the lean engine's refusals (``config.check_lean_settings``) apply here when
it will serve, so a start stops before any worker.

May import: ``handler.config`` and ``handler.errors``. Nothing else of the server."""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from handler.config import DEFAULT_MODEL_DIR, ENV_NAMES, LMI_ENTRY_POINTS, REPO_ROOT, Settings, check_lean_settings
from handler.errors import ConfigError

SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")


def vllm_installed() -> bool:
    """Whether vLLM can be imported, without importing it (seconds, and torch with it)."""
    return importlib.util.find_spec("vllm") is not None


def parse_properties(text: str) -> dict[str, str]:
    """``key=value`` lines; ``#`` and ``!`` start comments (java.util.Properties, without line continuations)."""
    values = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        match = re.fullmatch(r"([^=:\s]+)\s*[=:]\s*(.*)", line)
        if not match:
            raise ConfigError(f"serving.properties line {number}: expected key=value, got {raw!r}")
        values[match.group(1)] = match.group(2)
    return values


def _setting_name(key: str) -> str:
    """``option.max_model_len`` -> ``max_model_len``; ``engine`` -> ``engine``."""
    return key[len("option."):] if key.startswith("option.") else key


def env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    values = {}
    for name, value in environ.items():
        if name.startswith("OPTION_") and len(name) > len("OPTION_"):
            rest = name[len("OPTION_"):]
            values[rest.lower() if rest.isupper() else rest] = value
    if "HF_MODEL_ID" in environ:
        values["model_id"] = environ["HF_MODEL_ID"]
    return values


def properties_path(environ: Mapping[str, str], model_root: Path) -> Path | None:
    named = environ.get("SERVING_PROPERTIES")
    if named:
        if not Path(named).is_file():
            raise ConfigError(f"SERVING_PROPERTIES={named!r}: no such file")
        return Path(named)
    for candidate in (model_root / "serving.properties", REPO_ROOT / "serving.properties"):
        if candidate.is_file():
            return candidate
    return None


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Build the settings; raise ``ConfigError`` with one line naming the key and the reason."""
    environ = os.environ if environ is None else environ
    model_root = Path(environ.get("SAGEMAKER_MODEL_DIR", SAGEMAKER_MODEL_DIR))
    path = properties_path(environ, model_root)
    raw = {_setting_name(k): v for k, v in parse_properties(path.read_text()).items()} if path else {}
    raw.update(env_overrides(environ))
    if "entrypoint" in raw:  # OPTION_ENTRYPOINT, as LMI's own examples spell it
        raw["entryPoint"] = raw.pop("entrypoint")
    named_by = {}  # setting -> the environment name that filled it (errors name what the user wrote)
    for name, alias in ENV_NAMES.items():  # they only fill what ours leave unset
        if name in environ and alias not in raw:
            raw[alias], named_by[alias] = environ[name], name
    apply_lmi_entry_point(raw)
    if not raw.get("model_id") and holds_model(model_root):
        raw["model_id"] = str(model_root)
    try:
        settings = Settings(**raw)
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "?"
        reason = "unknown setting" if first["type"] == "extra_forbidden" else first["msg"]
        where = f"{named_by[key]} (option.{key})" if key in named_by else f"option.{key}"
        raise ConfigError(f"invalid setting {where}={raw.get(key, '')!r}: {reason}") from None
    check_model_dir(settings)
    # auto with vLLM installed decides in the worker (CUDA or not): loader.create_backend checks then
    if settings.rolling_batch == "vllm" and not vllm_installed():
        raise ConfigError("option.rolling_batch='vllm': vLLM is not installed in this environment (`make serve-vllm` "
                          "builds .venv-vllm with it; the cuda image has it)")
    lean_only = settings.rolling_batch in ("lean", "transformers")
    if lean_only or (settings.rolling_batch == "auto" and not vllm_installed()):
        check_lean_settings(settings, named_by)
    return settings


def apply_lmi_entry_point(raw: dict[str, str]) -> None:
    """LMI's vLLM handler as ``option.entryPoint``: the built-in handler on vLLM (option.rolling_batch=vllm unless
    set; set to another engine, the two contradict each other and the start stops naming both)."""
    entry_point = raw.get("entryPoint")
    wanted = LMI_ENTRY_POINTS.get(entry_point or "")
    if wanted is None:
        return
    chosen = raw.get("rolling_batch", "auto")
    if chosen not in ("auto", wanted):
        raise ConfigError(f"option.entryPoint={entry_point!r} runs on {wanted}, and option.rolling_batch={chosen!r} "
                          f"names another engine: set option.rolling_batch={wanted} or leave it unset")
    if not vllm_installed():
        raise ConfigError(f"option.entryPoint={entry_point!r} is LMI's vLLM handler, and vLLM is not installed in "
                          "this environment: leave option.entryPoint unset for the built-in engine (the cuda image "
                          "has vLLM)")
    raw["rolling_batch"] = wanted


def holds_model(folder: Path) -> bool:
    """A model folder: a checkpoint (config.json), or a handler (model.py) that may serve without one."""
    return (folder / "config.json").is_file() or (folder / "model.py").is_file()


def is_remote(model_id: str | None) -> bool:
    """A model id that names a download (``handler.download``) rather than a folder: ``s3://...``, or ``org/name``
    where no such folder exists."""
    if not model_id or Path(model_id).exists():
        return False
    return "://" in model_id or re.fullmatch(r"[\w.-]+/[\w.-]+", model_id) is not None


def check_model_dir(settings: Settings) -> None:
    """The model folder holds a model (a remote model id is checked by ``handler.download`` once downloaded)."""
    model_id, folder = settings.model_id, settings.model_dir
    if is_remote(model_id):
        return
    if model_id and not folder.exists():
        raise ConfigError(f"option.model_id={model_id!r}: no such folder")
    has_handler = settings.custom_entry_point is not None or (settings.entryPoint is None and
                                                              (folder / "model.py").is_file())
    if not (folder / "config.json").is_file() and not (has_handler and settings.builtin_engine != "true"):
        hint = " (run `make model` to assemble the embedded default)" if folder == DEFAULT_MODEL_DIR else ""
        raise ConfigError(f"option.model_id: {folder} holds no model (config.json is missing){hint}")
