"""The session contract of crossrt/run/runtime.py, one test over every driven runtime (llama-cpp,
transformers, exllamav3 on a GPU), each on the tiny pair's own files for that runtime: which
logits rows eval returns, where truncate cuts the cache, the context limit, and a lifetime
that ends once, in close() or a with block."""

import numpy as np
import pytest

from crossrt.errors import PromptRefused
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import Rows, RuntimeOptions, availability, open_runtime


PROMPT = load_prompts("builtin")[0]
N_CTX = 512
# Max |logit difference| between one long pass and the same positions re-evaluated after a
# truncate. F32 caches (transformers) repeat to rounding; F16 caches (llama.cpp's default,
# exllamav3's) round the cached keys and values, and the kernels differ by batch shape.
RUNTIMES = [
    pytest.param(("llama-cpp", "gguf", 2e-2), id="llama-cpp"),
    pytest.param(("transformers", "hf", 1e-5), id="transformers"),
    pytest.param(("exllamav3", "hf", 5e-2), id="exllamav3", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(availability("exllamav3") is not None,
                           reason=f"needs a CUDA GPU: {availability('exllamav3')}")]),
]


@pytest.fixture(params=RUNTIMES)
def contract(request, tiny_pair):
    name, model_format, tolerance = request.param
    runtime = open_runtime(name, RuntimeOptions(n_ctx=N_CTX, threads=1))
    with runtime.load(tiny_pair.path("target", model_format)) as session:
        yield session, tolerance


def test_rows_and_truncate_follow_the_contract(contract):
    session, tolerance = contract
    ids = session.tokenize(PROMPT.text)
    every = session.eval(ids, Rows.ALL).copy()
    assert every.shape == (len(ids), session.n_vocab) and session.n_past == len(ids)
    session.truncate(len(ids) + 5)  # past the cache: nothing to drop
    assert session.n_past == len(ids)
    session.truncate(len(ids) - 3)
    assert session.n_past == len(ids) - 3
    again = session.eval(ids[-3:], Rows.ALL)
    np.testing.assert_allclose(again, every[-3:], atol=tolerance)
    assert (again.argmax(axis=1) == every[-3:].argmax(axis=1)).all()
    session.truncate(2)
    assert session.eval(ids[2:-1], Rows.NONE).shape == (0, session.n_vocab)
    np.testing.assert_allclose(session.eval(ids[-1:], Rows.LAST), every[-1:], atol=tolerance)
    session.truncate(-1)  # below zero: an empty cache
    assert session.n_past == 0
    np.testing.assert_allclose(session.eval(ids, Rows.LAST), every[-1:], atol=tolerance)
    with pytest.raises(PromptRefused, match="context full"):
        session.eval([5] * N_CTX, Rows.LAST)
    assert session.n_past == len(ids)  # a refused eval leaves the cache as it was


def test_a_session_is_released_once(contract):
    session, _ = contract
    released = []
    release = session._release
    session._release = lambda: released.append(release())
    session.close()
    session.close()
    assert released == [None]
    with session:  # the with block of the fixture closes it again: still nothing more
        pass
    assert released == [None]
