"""Byte-exact reproduction of Go's ``encoding/json`` output for the few shapes the identity hash needs.

The checkpoint identity hash is a SHA-256 over ``json.Marshal`` output of Dynamo's Go operator, so a
single differing byte (an escape Python's ``json`` writes differently, a key order) would make this
controller and Dynamo's operator disagree about which checkpoint a worker may restore from.  This
follows ``appendString`` in Go's ``encoding/json/encode.go`` (Go >= 1.22, with HTML escaping on, as
``json.Marshal`` always has it).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["go_bytes", "go_quote", "go_string_map"]

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
