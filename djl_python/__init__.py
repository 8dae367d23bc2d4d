"""LMI's ``djl_python`` names, so a handler written for AWS LMI (DJL Serving) runs here unchanged.

``from djl_python import Input, Output`` gives this server's own handler types (handler/djl/types.py), which carry LMI's
method names and meanings; ``djl_python.encode_decode`` decodes and encodes bodies by content type as LMI's does.
Only the handler-facing API is here: LMI's engines (``djl_python.huggingface``, ``djl_python.lmi_vllm``, ...) are
settings of this server instead (``option.entryPoint`` maps them, handler/config.py).
"""

from djl_python.inputs import Input
from djl_python.outputs import Output
from djl_python.pair_list import PairList

__all__ = ["Input", "Output", "PairList"]
