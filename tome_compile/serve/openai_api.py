"""OpenAI's images API on the server's own jobs: ``POST /v1/images/generations``.

A request is OpenAI's (``prompt``, ``n``, ``size`` ``"WxH"``, ``response_format``, ``user``,
``model``) with the extensions the diffusion servers share (``seed``, ``num_inference_steps``,
``guidance_scale``, ``negative_prompt``) and ours (``ratio``). It becomes ``n`` :class:`Job` s with
the seeds ``seed, seed + 1, ...``, checked by the same rules as ``POST /generate``; the answer is
``{"created": ..., "data": [{"b64_json": ...}, ...]}`` and a refusal OpenAI's error object with
HTTP 400 (``/generate`` answers the same refusals with 422). No Ray here.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from tome_compile.serve.request import MAX_SEED, Job, Limits, RequestError, parse_job

__all__ = ["MAX_N", "OPENAI_FIELDS", "RENAMED", "error_body", "images_body", "parse_images_request"]

OPENAI_FIELDS = ("prompt", "n", "size", "response_format", "user", "model", "seed", "num_inference_steps",
                 "guidance_scale", "negative_prompt", "ratio")
MAX_N = 8
# our /generate names for the extensions spelled otherwise here
RENAMED = {"num_inference_steps": "steps"}


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def images_body(pngs: list[bytes], created: int) -> dict[str, Any]:
    """OpenAI's answer: each picture as base64 PNG."""
    return {"created": created, "data": [{"b64_json": base64.b64encode(png).decode("ascii")} for png in pngs]}


def _sizes(limits: Limits) -> list[str]:
    return [f"{s}x{s}" for s in limits.sizes]


def parse_images_request(body: Any, limits: Limits) -> list[Job]:
    """The ``n`` jobs an images request asks for, or a :class:`RequestError` naming the field (its
    ``field`` is OpenAI's ``param``)."""
    if not isinstance(body, dict):
        raise RequestError("body", f"must be a JSON object with the fields {list(OPENAI_FIELDS)}, not "
                           f"{type(body).__name__}")
    unknown = sorted(set(body) - set(OPENAI_FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"not taken here (the fields are {list(OPENAI_FIELDS)})")
    form = body.get("response_format")
    if form == "url":
        raise RequestError("response_format", "'url' is not served: this server returns the pictures inline; "
                           "ask for 'b64_json' (the default)")
    if form not in (None, "b64_json"):
        raise RequestError("response_format", f"{form!r} must be 'b64_json'")
    if body.get("negative_prompt") not in (None, ""):
        raise RequestError("negative_prompt", "not supported by this server's model (its sampler takes "
                           "one prompt per picture); leave it out")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise RequestError("n", f"{n!r} must be an integer in [1, {MAX_N}]")
    ours: dict[str, Any] = {"prompt": body.get("prompt")}
    size = body.get("size")
    if size is not None:
        match = re.fullmatch(r"(\d+)x(\d+)", size) if isinstance(size, str) else None
        if match is None or match[1] != match[2] or int(match[1]) not in limits.sizes:
            raise RequestError("size", f"{size!r} is not served here; sizes are {_sizes(limits)}")
        ours["size"] = int(match[1])
    for name in ("seed", "num_inference_steps", "guidance_scale", "ratio"):
        if body.get(name) is not None:
            ours[RENAMED.get(name, name)] = body[name]
    try:
        first = parse_job(ours, limits)
    except RequestError as e:  # the field under its name here
        name = next((k for k, v in RENAMED.items() if v == e.field), e.field)
        raise RequestError(name, str(e).split(": ", 1)[1]) from None
    if first.seed + n - 1 > MAX_SEED:
        raise RequestError("seed", f"{first.seed} + n - 1 is more than {MAX_SEED}")
    return [Job(prompt=first.prompt, seed=first.seed + i, settings=first.settings) for i in range(n)]
