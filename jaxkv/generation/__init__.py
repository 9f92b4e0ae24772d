"""Generation over the paged KV state, in the order a request runs:

request   checks and pads the prompts, sizes the prefill pool, places the model on the mesh;
prefill   chunked prefill with the policy's observations, then its compression;
decode    the public `decode_step` and the decode loop (after the repack into its geometry);
api       `generate` and `compress_prompt`;
mesh      programs whose arguments are placed on a device mesh by name.
"""

from jaxkv.generation.api import GenerateOutput, compress_prompt, generate
from jaxkv.generation.decode import GenState, StepContext, decode_step, step_keys
from jaxkv.generation.request import DEFAULT_PREFILL_CHUNK, PromptIds

__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "GenState",
    "GenerateOutput",
    "PromptIds",
    "StepContext",
    "compress_prompt",
    "decode_step",
    "generate",
    "step_keys",
]
