"""What the project's own text promises about itself."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A package index named by address (pip's --index-url / PIP_INDEX_URL values, the registries' hosts): described
# in words instead, since such addresses change and differ per mirror.
INDEX_ADDRESS = re.compile(r"(https?://\S*(pypi|pythonhosted|download\.pytorch|/whl/|/simple)\S*)", re.IGNORECASE)


def test_no_package_index_is_named_by_address():
    texts = [ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / "scripts").iterdir(), *(ROOT / ".ci").iterdir()]
    found = [f"{p.relative_to(ROOT)}: {m[0]}" for p in texts if p.is_file()
             for m in INDEX_ADDRESS.findall(p.read_text(errors="replace"))]
    assert not found, found
