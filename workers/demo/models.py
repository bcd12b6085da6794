"""Input and output models of the demo contracts; their JSON Schemas are the contracts' schemas."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ModelRef(BaseModel):
    modelId: str = Field(min_length=1)  # noqa: N815 - the seed's wire name


class CacheLookupOutput(BaseModel):
    modelId: str  # noqa: N815
    hit: bool


class RenderOutput(BaseModel):
    thumbnailUri: str  # noqa: N815


class SemanticOutput(BaseModel):
    tags: list[str]


class MetadataOutput(BaseModel):
    faces: int
    vertices: int


class PublishOutput(BaseModel):
    published: bool
    catalogueId: str  # noqa: N815


class CompensationOutput(BaseModel):
    undone: bool


class AuditOutput(BaseModel):
    recorded: bool


class IndexStepInput(BaseModel):
    index: str = Field(min_length=1)


class IndexStepOutput(BaseModel):
    index: str
    step: str
