"""``[trainer.weights]``: how a new version's full weights reach the inference backends.

``transport = "disk"`` (the default): the trainer exports the version (HF safetensors) and
the proxy has every backend load that directory (``/update_weights_from_disk``); backends
must see the trainer's file system. ``transport = "broadcast"``: the trainer sends the
weights itself, rank 0 of a torch process group with every backend's workers (``gloo`` on
CPU, ``nccl`` between GPUs), while the proxy pauses generation and records the version
exactly as for a disk push (``proxima.trainer.weight_broadcast``). With the torch backend
the weights go straight from the trainer's memory, cast to ``dtype``, and the version is
exported to disk only after the push, before the next step trains (the recovery rule and a
restarted backend read it: ``proxima.trainer.weights``); other backends export first and
broadcast the export. ``fallback_to_disk``: a broadcast push that fails (the group cannot
form, a member died mid-push) is made from disk instead (exported first when it was not).
LoRA adapters always go by disk (a peft directory is a few megabytes). Torch-free.
"""

from __future__ import annotations

from typing import Literal

from proxima.trainer.algorithm_config import StrictSection
from pydantic import Field


class WeightsConfig(StrictSection):
    """How full-weight versions travel to the backends (``[trainer.weights]``)."""

    transport: Literal["disk", "broadcast"] = Field(
        "disk",
        description="disk: backends load the exported directory; broadcast: the trainer "
        "sends the weights over a torch process group with every backend.",
    )
    fallback_to_disk: bool = Field(
        True, description="Push from disk when a broadcast push fails (else the step fails)."
    )
    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="torch.distributed backend of the group: gloo (CPU) or nccl (GPU)."
    )
    master_address: str | None = Field(
        None,
        description="Address the backends reach the trainer at (it hosts the rendezvous); "
        "default: this host's address on the route to the proxy.",
    )
    master_port: int = Field(
        0, ge=0, le=65535, description="Port of the rendezvous; 0 picks a free one per group."
    )
    bucket_mb: float = Field(
        512.0,
        gt=0.0,
        description="Tensors broadcast per call, in MiB (each backend holds one bucket extra).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype floating-point weights travel as from the trainer's memory: the one "
        "the backends serve (bfloat16 for most SGLang deployments halves the bytes of a float32 "
        "trainer); auto: the trainer's own, as its export holds them.",
    )
    timeout_s: float = Field(
        60.0,
        gt=0.0,
        le=3600.0,
        description="How long forming the group, or one bucket, may take before it fails.",
    )
