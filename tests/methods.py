"""Every decoding method in the project, for the greedy-equality and statistical exactness suites.

Adding a drafter or verification scheme to both suites is one line here: a name and a factory
`(target, draft) -> Drafter | None` (None = plain decoding through the same loop).
"""

from __future__ import annotations

import specdec

METHODS = {
    "plain": lambda target, draft: None,
    "draft-model": lambda target, draft: specdec.DraftModel(draft),
}
