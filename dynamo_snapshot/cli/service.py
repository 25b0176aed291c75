"""What the long-running commands (`controller`, `agent`) share: settings from a YAML file overridden by
flags, one-line errors with trustworthy exit codes, and a SIGTERM-aware event loop."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from dynamo_snapshot.cli.logs import setup_logging

M = TypeVar("M", bound=BaseModel)
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class ConfigError(Exception):
    """Settings that cannot be read or do not validate; the message is one line."""


def load_settings(model: type[M], path: Path | None, args: argparse.Namespace, flags: Iterable[str]) -> M:
    """`model` from the YAML file at `path` (if any), then every flag in `flags` that was given."""
    try:
        data: dict[str, Any] = (yaml.safe_load(path.read_text()) or {}) if path else {}
        base = model.model_validate(data)
        overrides = {k: getattr(args, k) for k in flags if getattr(args, k, None) is not None}
        return model.model_validate({**base.model_dump(), **overrides})
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config: {e}") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"invalid config: {tuple(err['loc'])}: {err['msg']}") from None


def run_service(
    name: str,
    args: argparse.Namespace,
    load: Callable[[], M],
    serve: Callable[[M, asyncio.Event], Coroutine[Any, Any, None]],
) -> int:
    """Load settings, then run `serve` until SIGTERM/SIGINT sets its stop event. Exit 0 / 1 / 2."""
    setup_logging(getattr(args, "log_level", "info"))
    try:
        settings = load()
    except ConfigError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return EXIT_USAGE

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop)

    try:
        asyncio.run(main())
    except Exception as e:  # the one place a crash becomes a one-line reason
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK
