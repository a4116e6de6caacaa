"""Small shared utilities (no process-group state lives here)."""
from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def working_dir(path: str | Path) -> Iterator[None]:
    """Run the block in `path` (a job's relative paths are read from the folder it runs in); the caller's folder
    comes back even on error. (contextlib.chdir needs Python 3.11; MindSpeed-MM's images run older ones.)"""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def free_port() -> int:
    """A TCP port free on this host now (for a job's rendezvous; torch-free, so launchers can call it cheaply)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
