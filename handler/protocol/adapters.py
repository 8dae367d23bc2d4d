"""The body of ``POST /adapters``: SageMaker's adapter registration (``model-hosting-container-standards``'
``SageMakerRegisterLoRAAdapterRequest``: name, src, preload, pin), validated here because that package's routes are
FastAPI's and this server is Flask."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# the headers that pick a request's adapter, the identifier first (SageMaker's LoRA contract)
ADAPTER_HEADERS = ("X-Amzn-SageMaker-Adapter-Identifier", "X-Amzn-SageMaker-Adapter-Alias")


class RegisterAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+$")
    src: str = Field(min_length=1)           # a local folder (file:// allowed) or an s3:// prefix
    preload: bool = True                     # load the weights now (else at first use)
    pin: bool = False                        # never evicted for another adapter (loaded now)
