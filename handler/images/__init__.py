"""Images in chat requests: fetch URLs safely (``fetch``), decode references to RGB (``decode``), and load a
request's images under its time and pixel budgets and the worker's fetch and memory caps (``loader``)."""

from handler.images.decode import DecodeLimits, decode_image_bytes, image_size, load_image
from handler.images.fetch import Deadline, FetchFailure, FetchPolicy, ImageFetchError, fetch_image_bytes
from handler.images.loader import ImageLoader, LoadBudget, LoadObserver

__all__ = ["Deadline", "DecodeLimits", "FetchFailure", "FetchPolicy", "ImageFetchError", "ImageLoader", "LoadBudget",
           "LoadObserver", "decode_image_bytes", "fetch_image_bytes", "image_size", "load_image"]
