"""Images in chat requests: which URLs may be fetched (``policy``: the SSRF rules), name lookups within the fetch's
deadline (``resolve``), the pinned fetch (``fetch``), decoding references to RGB (``decode``), and loading a
request's images under its time and pixel budgets and the worker's fetch and memory caps (``loader``)."""

from handler.images.decode import DecodeLimits, decode_image_bytes, image_size, load_image
from handler.images.fetch import Deadline, fetch_image_bytes
from handler.images.loader import ImageLoader, LoadBudget, LoadObserver
from handler.images.policy import FetchFailure, FetchPolicy, ImageFetchError
from handler.images.resolve import Resolver

__all__ = ["Deadline", "DecodeLimits", "FetchFailure", "FetchPolicy", "ImageFetchError", "ImageLoader", "LoadBudget",
           "LoadObserver", "Resolver", "decode_image_bytes", "fetch_image_bytes", "image_size", "load_image"]
