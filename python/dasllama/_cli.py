"""What the command-line entry points share."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """`--help` shows each option's default, unless it has none or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is None or action.default is argparse.SUPPRESS or action.default is False or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()
