"""A tenant's chat template variables (policy.chat_template_kwargs) reach the operator's tokenizer's template on the
host in tito mode: only a JSON object of at most 4,096 characters, never one of the arguments the fleet sets at every
render (a `tokenize` or `add_generation_prompt` of the tenant's would change what every prompt is)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from orchestrator.core.policy import MAX_TEMPLATE_KWARGS, TEMPLATE_RENDER_ARGUMENTS, PolicyEndpoint


@pytest.mark.parametrize("argument", sorted(TEMPLATE_RENDER_ARGUMENTS))
def test_the_fleets_own_render_arguments_are_refused(argument: str) -> None:
    with pytest.raises(ValidationError, match="which the fleet sets itself at every render"):
        PolicyEndpoint(base_url="http://h/v1", chat_template_kwargs={argument: True})


def test_the_variables_are_a_bounded_json_object() -> None:
    big = {"x": "y" * MAX_TEMPLATE_KWARGS}
    with pytest.raises(ValidationError, match=f"at most {MAX_TEMPLATE_KWARGS} characters"):
        PolicyEndpoint(base_url="http://h/v1", chat_template_kwargs=big)
    for bad in ("[1]", '"text"', "{"):
        with pytest.raises(ValidationError, match="chat_template_kwargs"):
            PolicyEndpoint(base_url="http://h/v1", chat_template_kwargs=bad)
