"""LMI's ``djl_python.pair_list``: the ordered key/value parts of a request or an answer."""

from handler.djl import PairList

__all__ = ["PairList"]
