"""Byte-exact reproduction of Go's ``encoding/json`` for the few shapes the identity hash needs.

The checkpoint identity hash is a SHA-256 over ``json.Marshal`` output of Dynamo's Go operator, so a
single differing byte (an escape Python's ``json`` writes differently, a key order) would make this
controller and Dynamo's operator disagree about which checkpoint a worker may restore from.  Writing
follows ``appendString`` in Go's ``encoding/json/encode.go`` (Go >= 1.22, with HTML escaping on, as
``json.Marshal`` always has it); reading (:func:`go_unmarshal`) gives the strings Go's ``unquote`` in
``decode.go`` gives, so an identity read from a file hashes as it does once Go has decoded it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["go_bytes", "go_quote", "go_string_map", "go_unmarshal"]

_HEX = b"0123456789abcdef"

# Go's htmlSafeSet: printable ASCII except the characters that need escaping in JSON or in HTML.
_HTML_UNSAFE = frozenset(b'"\\<>&')
_SHORT_ESCAPES = {
    ord('"'): b'\\"',
    ord("\\"): b"\\\\",
    ord("\b"): b"\\b",
    ord("\f"): b"\\f",
    ord("\n"): b"\\n",
    ord("\r"): b"\\r",
    ord("\t"): b"\\t",
}
_LINE_SEPARATOR = "\u2028".encode()
_PARAGRAPH_SEPARATOR = "\u2029".encode()


def go_bytes(value: str | bytes) -> bytes:
    """The bytes of the Go string a Python value stands for.

    Python ``str`` cannot hold invalid UTF-8; it carries undecodable bytes as the surrogates
    U+DC80..U+DCFF (``surrogateescape``), which map back to those bytes.  Any other lone surrogate has
    no UTF-8 form, so it becomes the (invalid) bytes ``surrogatepass`` gives, which Go then replaces.
    """
    if isinstance(value, bytes):
        return value
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        pass
    out = bytearray()
    for char in value:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(code - 0xDC00)
        else:
            out += char.encode("utf-8", "surrogatepass")
    return bytes(out)


def _utf8_sequence_length(data: bytes, index: int) -> int:
    """Length of the valid UTF-8 sequence starting at ``index``, or 0 when Go would see RuneError/1."""
    lead = data[index]
    if 0xC2 <= lead <= 0xDF:
        size = 2
    elif 0xE0 <= lead <= 0xEF:
        size = 3
    elif 0xF0 <= lead <= 0xF4:
        size = 4
    else:
        return 0
    try:
        # Python's strict decoder rejects overlongs, surrogates and > U+10FFFF exactly as Go's
        # utf8.DecodeRune does.
        data[index : index + size].decode("utf-8")
    except UnicodeDecodeError:
        return 0
    return size


def go_quote(value: str | bytes) -> bytes:
    """``value`` as Go's ``json.Marshal`` writes a string, quotes included."""
    data = go_bytes(value)
    out = bytearray(b'"')
    index = 0
    while index < len(data):
        byte = data[index]
        if byte < 0x80:
            if byte >= 0x20 and byte not in _HTML_UNSAFE:
                out.append(byte)
            elif byte in _SHORT_ESCAPES:
                out += _SHORT_ESCAPES[byte]
            else:
                out += b"\\u00" + bytes((_HEX[byte >> 4], _HEX[byte & 0xF]))
            index += 1
            continue
        size = _utf8_sequence_length(data, index)
        if size == 0:
            out += b"\\ufffd"
            index += 1
            continue
        sequence = data[index : index + size]
        if sequence == _LINE_SEPARATOR:
            out += b"\\u2028"
        elif sequence == _PARAGRAPH_SEPARATOR:
            out += b"\\u2029"
        else:
            out += sequence
        index += size
    out += b'"'
    return bytes(out)


def go_string_map(mapping: Mapping[str, str] | Mapping[bytes, bytes]) -> bytes:
    """A ``map[string]string`` as Go marshals it: keys sorted by their bytes, no whitespace."""
    items = sorted((go_bytes(key), go_bytes(value)) for key, value in mapping.items())
    body = b",".join(go_quote(key) + b":" + go_quote(value) for key, value in items)
    return b"{" + body + b"}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _go_decoded(value: str) -> str:
    return _SURROGATE.sub("\ufffd", value)


def _go_strings(value: Any) -> Any:
    if isinstance(value, str):
        return _go_decoded(value)
    if isinstance(value, list):
        return [_go_strings(item) for item in value]
    if isinstance(value, dict):
        return {key: _go_strings(item) for key, item in value.items()}
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def go_unmarshal(data: str | bytes) -> Any:
    """A JSON document as Go's ``json.Unmarshal`` (and the apiserver's ``sigs.k8s.io/json``) reads it.

    Python's ``json`` joins an escaped UTF-16 surrogate pair into its character exactly as Go does, but
    keeps any other surrogate escape as a lone surrogate, which Go turns into U+FFFD; so does Go with
    every byte that is not UTF-8 (here carried as U+DC80..U+DCFF by ``surrogateescape``).  Every string
    that comes back is therefore valid Unicode.  ``NaN`` and ``Infinity``, which Go refuses, raise
    ``ValueError`` like any other malformed document.
    """
    text = data.decode("utf-8", "surrogateescape") if isinstance(data, bytes) else data
    # Keys are fixed in document order so that two keys which both become U+FFFD keep the later value,
    # as Go's map decoding does.
    document = json.loads(
        text,
        parse_constant=_refuse_constant,
        object_pairs_hook=lambda pairs: dict((_go_decoded(key), value) for key, value in pairs),
    )
    return _go_strings(document)
