"""LMI's ``djl_python.inputs``: the request type is the server's own, so what the server builds is what LMI
handlers expect."""

from handler.djl import Input

__all__ = ["Input"]
