"""Images in chat requests: fetch URLs safely (``fetch``) and decode references to RGB (``decode``)."""

from handler.images.decode import DecodeLimits, decode_image_bytes, load_image
from handler.images.fetch import FetchFailure, FetchPolicy, ImageFetchError, fetch_image_bytes

__all__ = ["DecodeLimits", "FetchFailure", "FetchPolicy", "ImageFetchError", "decode_image_bytes", "fetch_image_bytes",
           "load_image"]
