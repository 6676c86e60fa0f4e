"""crossrt's own errors: what a user can act on, said in one line.

The command line turns USER_ERRORS into one-line exits (crossrt/cli/common.py, user_errors);
any other exception is a bug and keeps its traceback. The driver catches only
PromptRefused, so one prompt that cannot run fails alone while a bug stops the run. Errors
about the content of an input file (a prompt file, a pair manifest, a record, a claim) are
also ValueErrors, as the parsers that raise them are.
"""


class CrossrtError(Exception):
    """An error crossrt explains: the message names what is wrong and what to do."""


class SettingsError(CrossrtError):
    """Settings that contradict each other, the runtime or the model (k, drafting rules,
    schedule, spec type, GPU split, KV cache type)."""


class ModelError(CrossrtError):
    """A model file or folder that a runtime cannot load or run."""


class PromptRefused(CrossrtError):
    """One prompt cannot run (empty, too long for the context, refused by the runtime): that
    prompt is kept as failed with this reason, and the run goes on."""


class PairError(CrossrtError, ValueError):
    """A manifest, model file or vocabulary problem, with a message meant for the user."""


class ComparisonError(CrossrtError):
    """Records that cannot be compared or checked as asked (other vocabularies, another
    schedule or prompt than the simulation, nothing to compare)."""


# What a user can act on, said in one line wherever crossrt reports it (a command's exit, a sweep
# cell's failure): crossrt's own errors and a missing file. Anything else is a bug.
USER_ERRORS = (CrossrtError, FileNotFoundError)
