"""What the product must not say of itself (the project's history lives in CHANGELOG.md and
git): one definition, read by the docs check (tests/unit/test_docs_rendered.py) and the
whole-tree check (tests/unit/test_history_words.py)."""

from __future__ import annotations

import re

HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
"""A hand-typed commit hash: 7-40 hex digits as a word, with a digit and a letter."""
HISTORY = re.compile(
    r"(?i)\b(?:issues?|PRs?|pull requests?|stops?|turns?|sessions?)\s+#?\d+\b"
    r"|\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])(?:-[0-3]\d)?\b"
)
"""kvray's issue numbers, session words (a stop or turn with its number) and ISO dates,
a month (``YYYY-MM``) too."""
