"""The base of every model handle."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar


class ModelHandle:
    """A model as the host and passes see it.

    ``kind`` is matched against :attr:`bitpress.passes.Pass.model_kinds`; ``source`` is the
    path the model was loaded from (never written to).
    """

    kind: ClassVar[str] = "?"

    def __init__(self, source: Path) -> None:
        self.source = Path(source)

    def describe(self) -> str:
        return f"{self.kind} model {self.source}"
