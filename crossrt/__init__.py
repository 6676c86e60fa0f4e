"""crossrt: run the same drafter/target pair through several runtimes, normalize their
speculative-decoding statistics into one schema, and check that they agree.

Importing crossrt imports no runtime (llama_cpp, torch, exllamav3): see crossrt.run.runtime.
"""

__version__ = "0.1.0"
