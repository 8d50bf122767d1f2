"""Errors the engine raises for bad input; each names the field and what is allowed."""

from __future__ import annotations

import re


class HalfmoonError(Exception):
    """Base of every error halfmoon raises on purpose."""


class InvalidRequestError(HalfmoonError, ValueError):
    """A request field is out of range; the message names the field and the allowed range."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        super().__init__(f"{field}={value!r} is invalid: {allowed}")
        self.field = field
        self.value = value
        self.allowed = allowed

    def renamed(self, field: str) -> InvalidRequestError:
        """The same error under `field`, the name a client gave the field (an API's own name for
        an engine field), in the message's explanation too."""
        allowed = re.sub(rf"\b{re.escape(self.field)}\b", field, self.allowed)
        return InvalidRequestError(field, self.value, allowed)


class ModelLoadError(HalfmoonError):
    """The model cannot load as configured: its directory is missing or incomplete, its
    architecture unsupported, or the devices cannot hold it as asked (memory, GPU count)."""


class RequestNotFoundError(HalfmoonError, KeyError):
    """No request with this id is known where it was looked up; `known` says what was searched."""

    def __init__(self, request_id: str, known: str = "in flight") -> None:
        super().__init__(request_id, known)
        self.request_id = request_id
        self.known = known

    def __str__(self) -> str:  # KeyError's own str() is only repr(request_id)
        return f"no request {self.request_id!r} is {self.known}"


class OutOfPagesError(HalfmoonError):
    """Not enough free KV pages to hold a request right now; retry elsewhere or later."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"needs {needed} free KV pages, {free} are free")
        self.needed = needed
        self.free = free


class RankFailedError(HalfmoonError):
    """A rank of a tensor-parallel engine died or failed; the engine cannot step without it."""


class DeviceFailedError(HalfmoonError):
    """A step failed with an error the device keeps (a CUDA error such as an illegal memory
    access sticks to the process's context): the engine cannot step again, and its worker
    fails its health check so that the controller replaces it."""


# What a device error's message says where torch raises it as a plain RuntimeError.
STICKY_DEVICE_ERRORS = (
    "CUDA error",
    "illegal memory access",
    "device-side assert",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "unspecified launch failure",
)


def is_device_failure(error: BaseException) -> bool:
    """Whether a step's error leaves the device unusable (see `DeviceFailedError`): torch's
    `AcceleratorError`, or a RuntimeError naming a CUDA error. An ordinary exception (a bad
    input that got through, a store gone mid-load) leaves the engine serving."""
    import torch  # here: the errors are imported by clients that never load torch

    accelerator = getattr(torch, "AcceleratorError", ())
    if accelerator and isinstance(error, accelerator):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in STICKY_DEVICE_ERRORS)
