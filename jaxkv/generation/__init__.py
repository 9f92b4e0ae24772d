"""Generation over the paged KV state, in the order a request runs:

request       checks and pads the prompts, sizes the prefill pool, places the model on the mesh;
observations  what prefill carries from chunk to chunk for the policy (last queries, moments);
prefill       chunked prefill with the policy's observations, then its compression;
loop          the decode loop over `jaxkv.step.decode.decode_and_sample` (after the repack into
              its geometry);
session       `Session`: `prefill`, `extend` and `fork` over a prefilled context (import them
              from `jaxkv`: here `prefill` names the module);
decoding      `decode`: the decode driver of a session, its `GenerateOutput`;
api           `generate`, `compress_prompt` and `ask`, built on sessions;
saved         `save_session` / `load_session`: a session written to a directory, read back;
budgets       `prefill_each`: one prefill, then each of several policies' or budgets' compressions;
joined        `join_sessions`: one-row sessions decoded together as the rows of one;
mesh          programs whose arguments are placed on a device mesh by name.
"""

from jaxkv.generation.api import AskOutput, ask, compress_prompt, generate, generate_text
from jaxkv.generation.decoding import GenerateOutput
from jaxkv.generation.loop import GenState
from jaxkv.generation.request import DEFAULT_PREFILL_CHUNK, PromptIds
from jaxkv.generation.session import Session, extend_with_logits
from jaxkv.step.decode import StepContext, decode_step
from jaxkv.step.rows import Rows

__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "AskOutput",
    "Session",
    "ask",
    "extend_with_logits",
    "GenState",
    "GenerateOutput",
    "PromptIds",
    "Rows",
    "StepContext",
    "compress_prompt",
    "decode_step",
    "generate",
    "generate_text",
]
