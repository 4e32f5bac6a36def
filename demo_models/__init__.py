"""Tandem's locally built demo draft/target model pair (see docs/demo_models.md).

``python -m demo_models --variant {full,tiny} --out DIR`` builds it; ``build()`` is the API.
"""

from .build import VARIANTS, build

__all__ = ["VARIANTS", "build"]
