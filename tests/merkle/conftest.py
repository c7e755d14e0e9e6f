"""Make the repository root importable when pytest is started as `.venv/bin/pytest`.

The project is not installed into the venv and pyproject sets no `pythonpath`, so without this the
`ledger` package is only found when pytest runs as `python -m pytest` from the root.
"""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
