"""How every API model parses (the spec's and the status's): fields are spelled in camelCase as the
API server stores them, unknown fields are refused, enums are kept as their values, and defaults
are checked like any value."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=True,
        validate_default=True,
    )
