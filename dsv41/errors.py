"""The errors a user can cause, apart from the ones that are bugs.

Every exception dsv41 raises for something the user gave — a config, a checkpoint, a tokenizer, a
prompt, sampling settings, model inputs, an argument — is a `UserError` whose message names the culprit;
the command line prints it as one line (exit status 2). Anything else escaping is a bug, and the command
line says so. (`UserError` is a ValueError, so code that caught ValueError keeps working.)
"""

from __future__ import annotations


class UserError(ValueError):
    """Something the user gave is wrong; the message says what and where."""


class InputError(UserError):
    """Inputs of a call that cannot be run: token ids, a cache, a request, sampling settings."""


class ImageError(InputError):
    """An image that cannot be used: not an image, truncated, too large, an unsupported mode or source."""


class CheckpointError(UserError):
    """A checkpoint directory or file that is not what it must be (names the file and the tensor)."""


class RankLostError(UserError):
    """A peer process of a parallel run died or stopped answering within the timeout (names the rank
    and what this rank was doing); the run cannot continue and every surviving rank exits."""
