#!/usr/bin/env python
"""Django's command-line utility: `python manage.py runserver`, `migrate`, `tlt_demo`, ..."""

import os
import sys
from pathlib import Path


def main() -> None:
    # platform/ is a source root, never a package (it would shadow the stdlib `platform`).
    # The editable install already puts it on sys.path; this covers a bare checkout.
    root = Path(__file__).resolve().parent
    for path in (root / "platform", root):
        if str(path) not in sys.path:
            sys.path.append(str(path))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tltweb.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
