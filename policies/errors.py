"""The one exception the policy loader raises, carrying every problem it found as a line a human can act on."""

from __future__ import annotations


class PolicyError(Exception):
    """A policy file is invalid.

    ``errors`` holds one line per problem, each ``FILE:LINE:COL: YAML.PATH (Kind 'name'): what is wrong;
    what to do``. The gateway logs them and keeps serving the previous policy; ``specgate policy check``
    prints them. ``str(error)`` joins them with newlines.
    """

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))
