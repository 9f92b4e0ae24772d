"""Sessions joined into one decode (`jaxkv.generation.joined`): one-row sessions compressed by
different policies at different budgets, a question read over each, decode as the rows of one
session to each one's own tokens; sessions whose policies act while decoding, or whose
budgets or thresholds differ in columns, are refused."""

import numpy as np
import pytest

import jaxkv
from jaxkv import bundled, policies, prose
from jaxkv.generation.joined import join_sessions
from jaxkv.models import load_hf_checkpoint


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(bundled.REFERENCE_MODEL)


CONTEXT = list(" ".join(prose.paragraphs()[:4])[:900].encode())
QUESTION = list(b"\nIn short, the text says that ")
COMPRESS_ONLY = (
    policies.get("full"),
    policies.get("snapkv", budget=0.3),
    policies.get("tova", budget=0.5),
    policies.get("knorm", budget=0.125),
    policies.get("kvzip", ratio=0.3),
)


def test_joined_rows_decode_as_each_session_alone(model):
    sessions = [
        jaxkv.prefill(model, [CONTEXT], policy, reserve_tokens=48).extend([QUESTION])
        for policy in COMPRESS_ONLY
    ]
    alone = [jaxkv.decode(session, 12, stop_tokens=[]) for session in sessions]
    joined = jaxkv.decode(join_sessions(sessions, 12), 12, stop_tokens=[])
    for row, out in enumerate(alone):
        np.testing.assert_array_equal(joined.tokens[row], out.tokens[0], err_msg=str(row))
    held = [int(np.sum(np.asarray(s.kv.positions()) >= 0)) for s in sessions]
    assert held[0] > held[2] > held[3]  # the rows hold what their own policies kept


@pytest.mark.parametrize(
    ("second", "match"),
    [
        (policies.get("streaming_llm", budget=0.5, evict_every=8), "acts while decoding"),
        (policies.get("h2o", budget=0.5), "acts while decoding"),
        (policies.get("chunkkv", budget=0.5), "thresholds have different columns"),
    ],
)
def test_sessions_whose_policies_act_while_decoding_are_refused(model, second, match):
    sessions = [jaxkv.prefill(model, [CONTEXT], p) for p in (COMPRESS_ONLY[1], second)]
    with pytest.raises(ValueError, match=match):
        join_sessions(sessions, 4)
