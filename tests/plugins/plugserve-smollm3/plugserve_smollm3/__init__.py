"""plugserve-smollm3: the SmolLM3 architecture (HuggingFaceTB/SmolLM3-3B) for plugserve,
added from outside its tree exactly as any third party would add one.

The entry point in pyproject.toml makes plugserve load this module in every process;
`register_models` names the class by reference, so the API-server process, which loads
every plugin but never builds a model, never imports the model code (model.py, torch).
A checkpoint whose config.json says `"architectures": ["SmolLM3ForCausalLM"]` then
serves with `plugserve serve --model <folder>`, and `plugserve models` lists it.
"""

from __future__ import annotations

from plugserve import hookimpl


@hookimpl
def register_models(register):
    register("SmolLM3ForCausalLM", "plugserve_smollm3.model:SmolLM3ForCausalLM")
