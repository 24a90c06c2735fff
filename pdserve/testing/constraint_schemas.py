"""JSON schemas of the structured-output tests and benchmark (issue 18): nested objects, arrays, enums,
bounded numbers, required and optional fields, anyOf."""

from __future__ import annotations

SCHEMAS = [
    {  # a flat object, every field required
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # an enum and a bounded number
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["color", "score"],
        "additionalProperties": False,
    },
    {  # an array of strings, bounded length
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {  # nested objects, an optional field
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "email": {"type": "string"},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {  # anyOf
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "null"}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    {  # an array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 4,
    },
    {  # a tool call's arguments: the shape OpenAI tools use
        "type": "object",
        "properties": {
            "location": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["location", "unit"],
        "additionalProperties": False,
    },
    {"type": "string", "maxLength": 20},  # a bare string
]
