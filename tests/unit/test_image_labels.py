"""The images declare what SageMaker reads from their labels: the port setting it may pass, and the WebSocket at
/invocations-bidirectional-stream (without the label, InvokeEndpointWithBidirectionalStream is refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LABELS = ("com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true",
          "com.amazonaws.sagemaker.capabilities.bidirectional-streaming=true")


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_each_image_carries_the_capability_labels(dockerfile: str) -> None:
    labels = {line.split(None, 1)[1].strip() for line in (ROOT / dockerfile).read_text().splitlines()
              if line.startswith("LABEL ")}
    assert set(LABELS) <= labels, dockerfile
