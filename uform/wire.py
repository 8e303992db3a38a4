"""The HTTP server's wire format: request bodies checked into items, answers and errors written as JSON in the
shapes OpenAI's embeddings API uses (so its clients work unchanged), plus uform's documented extensions.

`POST /v1/embeddings` takes `{"input": ..., "model": ..., "dimensions": ..., "encoding_format": ...,
"user": ...}`. `input` is a string or a list of items, an item being a string (text) or an object
`{"type": "text", "text": "..."}` or `{"type": "image" | "video" | "audio", "data": "data:<mime>;base64,..."}`
(uform's extension: media travel inline as base64 data URLs; the server fetches no URLs). Token-id arrays,
which OpenAI also takes, are refused: uform reads text as its UTF-8 bytes, not a tokenizer's ids.
`POST /v1/maxsim` takes `{"queries": [items], "documents": [items], "model": ...}`.

Every refusal is a `RequestError`: an HTTP status, the offending field's path (`input[3].data`) and a message
that starts with that path, answered as OpenAI's error object `{"error": {"message", "type", "param",
"code"}}`, which OpenAI's client raises as `BadRequestError` and its kin.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .enums import Modality

__all__ = [
    "EmbeddingRequest",
    "Item",
    "MaxsimRequest",
    "RequestError",
    "embedding_response",
    "error_body",
    "parse_body",
    "parse_embedding_request",
    "parse_maxsim_request",
]

ENCODING_FORMATS = ("float", "base64")
_EMBEDDING_FIELDS = {"input", "model", "dimensions", "encoding_format", "user"}
_MAXSIM_FIELDS = {"queries", "documents", "model", "user"}
_MEDIA_TYPES = {"image": Modality.Image, "video": Modality.Video, "audio": Modality.Audio}
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error", 503: "overloaded"}


class RequestError(ValueError):
    """A request the server refuses: `status` (4xx, or 503 when it is full), the field `param` it names
    (None: the request as a whole) and a message naming that field and the rule."""

    def __init__(self, status: int, param: str | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.message = message


@dataclass(frozen=True)
class Item:
    """One input: its modality and its bytes (a text's UTF-8, a media file's encoded bytes)."""

    modality: Modality
    content: bytes


@dataclass(frozen=True)
class EmbeddingRequest:
    """A checked `/v1/embeddings` body."""

    items: list[Item]
    width: int  # the Matryoshka width asked for (the full width when `dimensions` is absent)
    encoding_format: str  # "float" | "base64"


@dataclass(frozen=True)
class MaxsimRequest:
    """A checked `/v1/maxsim` body."""

    queries: list[Item]
    documents: list[Item]


def error_body(error: RequestError) -> dict[str, Any]:
    """OpenAI's error object for `error`."""
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": None}}


def parse_body(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body; a body that is no JSON object is a 400 naming where it broke."""
    try:
        value = json.loads(body)
    except UnicodeDecodeError as error:
        raise RequestError(400, None, f"body: not UTF-8 JSON ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise RequestError(
            400, None, f"body: malformed JSON ({error.msg} at line {error.lineno} column {error.colno})"
        ) from None
    except RecursionError:
        raise RequestError(400, None, "body: JSON nested too deeply") from None
    except ValueError as error:  # an integer of more digits than Python converts (sys.set_int_max_str_digits)
        raise RequestError(400, None, f"body: unreadable JSON ({error})") from None
    if not isinstance(value, dict):
        raise RequestError(400, None, f"body: expected a JSON object, got {_json_type(value)}")
    return value


def parse_embedding_request(
    body: dict[str, Any], *, widths: Sequence[int], modalities: Sequence[Modality], max_inputs: int
) -> EmbeddingRequest:
    """Checks an `/v1/embeddings` body against the served model: its Matryoshka `widths`, the `modalities` it
    embeds, and the most inputs a request may carry."""
    _known_fields(body, _EMBEDDING_FIELDS)
    _model_field(body)
    if "input" not in body:
        raise RequestError(400, "input", "input: required (a string or a list of items)")
    items = _items(body["input"], "input", modalities, max_inputs)
    width = max(widths)
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise RequestError(400, "dimensions", f"dimensions: expected an integer, got {_json_type(dimensions)}")
        if dimensions not in widths:
            raise RequestError(
                400,
                "dimensions",
                f"dimensions: {dimensions} is not a width this model trained; it serves {', '.join(map(str, widths))}",
            )
        width = dimensions
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if not isinstance(encoding, str) or encoding not in ENCODING_FORMATS:
        shown = repr(encoding) if isinstance(encoding, str) else _json_type(encoding)
        raise RequestError(400, "encoding_format", f"encoding_format: expected 'float' or 'base64', got {shown}")
    _user_field(body)
    return EmbeddingRequest(items, width, encoding)


def parse_maxsim_request(body: dict[str, Any], *, modalities: Sequence[Modality], max_inputs: int) -> MaxsimRequest:
    """Checks a `/v1/maxsim` body: `queries` and `documents`, each a non-empty list of items."""
    _known_fields(body, _MAXSIM_FIELDS)
    _model_field(body)
    _user_field(body)
    lists = []
    for name in ("queries", "documents"):
        if name not in body:
            raise RequestError(400, name, f"{name}: required (a list of items)")
        if not isinstance(body[name], list):
            raise RequestError(400, name, f"{name}: expected a list of items, got {_json_type(body[name])}")
        lists.append(_items(body[name], name, modalities, max_inputs))
    if len(lists[0]) + len(lists[1]) > max_inputs:
        raise RequestError(
            400, None, f"queries, documents: {len(lists[0]) + len(lists[1])} items in all, at most {max_inputs}"
        )
    return MaxsimRequest(lists[0], lists[1])


def embedding_response(vectors: np.ndarray, encoding_format: str, model: str, usage: dict[str, int]) -> dict[str, Any]:
    """OpenAI's embeddings answer for `vectors` [N, W] f32: floats as JSON numbers (each f32 exactly, through
    its f64 value), or base64 of the little-endian f32 bytes (what OpenAI's client decodes)."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")  # [N, W]
    data = []
    for i, row in enumerate(rows):
        embedding: Any = base64.b64encode(row.tobytes()).decode() if encoding_format == "base64" else row.tolist()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return {"object": "list", "data": data, "model": model, "usage": usage}


# ---- items -----------------------------------------------------------------------------------------


def _items(value: Any, field: str, modalities: Sequence[Modality], max_inputs: int) -> list[Item]:
    if isinstance(value, str):
        return [_text(value, field)]
    if not isinstance(value, list):
        raise RequestError(400, field, f"{field}: expected a string or a list of items, got {_json_type(value)}")
    if not value:
        raise RequestError(400, field, f"{field}: an empty list; give at least one item")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise RequestError(400, field, f"{field}: {_NO_TOKEN_IDS}")
    if len(value) > max_inputs:
        raise RequestError(400, field, f"{field}: {len(value)} items, at most {max_inputs} a request")
    return [_item(v, f"{field}[{i}]", modalities) for i, v in enumerate(value)]


_NO_TOKEN_IDS = (
    "token-id arrays are not supported: uform reads text as its UTF-8 bytes, not a tokenizer's ids; send the text "
    "as a string"
)


def _item(value: Any, field: str, modalities: Sequence[Modality]) -> Item:
    if isinstance(value, str):
        return _text(value, field)
    if isinstance(value, list):
        raise RequestError(400, field, f"{field}: {_NO_TOKEN_IDS}")
    if not isinstance(value, dict):
        raise RequestError(400, field, f"{field}: expected a string or an item object, got {_json_type(value)}")
    kind = value.get("type")
    if not isinstance(kind, str) or (kind != "text" and kind not in _MEDIA_TYPES):
        shown = repr(kind) if isinstance(kind, str) else _json_type(kind)
        raise RequestError(
            400, f"{field}.type", f"{field}.type: expected 'text', 'image', 'video' or 'audio', got {shown}"
        )
    payload = "text" if kind == "text" else "data"
    for key in value:
        if key not in ("type", payload):
            raise RequestError(
                400,
                f"{field}.{key}",
                f"{field}.{key}: unknown field of {_article(kind)} {kind} item (it takes 'type' and '{payload}')",
            )
    if payload not in value:
        raise RequestError(400, f"{field}.{payload}", f"{field}.{payload}: required for {_article(kind)} {kind} item")
    if kind == "text":
        text = value["text"]
        if not isinstance(text, str):
            raise RequestError(400, f"{field}.text", f"{field}.text: expected a string, got {_json_type(text)}")
        return _text(text, f"{field}.text")
    modality = _MEDIA_TYPES[kind]
    if modality not in modalities:
        served = ", ".join(m.name.lower() for m in modalities)
        raise RequestError(
            400, f"{field}.type", f"{field}.type: this model embeds no {kind} items (it embeds {served})"
        )
    return Item(modality, _data_url(value["data"], f"{field}.data"))


def _text(text: str, field: str) -> Item:
    if not text:
        raise RequestError(400, field, f"{field}: an empty string; every text needs at least one character")
    try:
        return Item(Modality.Text, text.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate from a JSON "\ud800" escape
        raise RequestError(400, field, f"{field}: not encodable as UTF-8 (a lone surrogate)") from None


def _data_url(value: Any, field: str) -> bytes:
    """The bytes of a `data:[<mime type>][;...];base64,<payload>` URL (RFC 2397)."""
    if not isinstance(value, str):
        raise RequestError(400, field, f"{field}: expected a data URL string, got {_json_type(value)}")
    head, comma, payload = value.partition(",")
    if not head.startswith("data:") or not comma:
        raise RequestError(
            400, field, f"{field}: expected a data URL ('data:<mime type>;base64,<bytes>'); the server fetches no URLs"
        )
    if not head.endswith(";base64"):
        raise RequestError(400, field, f"{field}: a media data URL must be base64 ('data:<mime type>;base64,...')")
    try:
        content = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, field, f"{field}: the data URL's payload is not valid base64") from None
    if not content:
        raise RequestError(400, field, f"{field}: the data URL holds no bytes")
    return content


# ---- fields ----------------------------------------------------------------------------------------


def _known_fields(body: dict[str, Any], known: set[str]) -> None:
    # An unknown field is refused, not ignored: a misspelt `dimension` would otherwise answer the full width.
    for key in body:
        if key not in known:
            raise RequestError(400, key, f"{key}: unknown field (this endpoint takes {', '.join(sorted(known))})")


def _model_field(body: dict[str, Any]) -> None:
    # One model is served, so any name is accepted (as local OpenAI-compatible servers do); the answer names it.
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "model", f"model: expected a string, got {_json_type(model)}")


def _user_field(body: dict[str, Any]) -> None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(400, "user", f"user: expected a string, got {_json_type(user)}")


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, as a client wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a non-finite number" if isinstance(value, float) and not math.isfinite(value) else "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"
