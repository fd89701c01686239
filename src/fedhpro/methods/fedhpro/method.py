"""FedHPro's entry in the method registry: its options, server and client under the name ``fedhpro``."""

from __future__ import annotations

from fedhpro.methods.base import MethodSpec
from fedhpro.methods.fedhpro.client import FedHProClient
from fedhpro.methods.fedhpro.options import AUTHORS_RECIPE, DESCRIPTION, FedHProOptions
from fedhpro.methods.fedhpro.server import FedHProServer

METHOD = MethodSpec(
    name="fedhpro",
    paper_order=8,
    options=FedHProOptions,
    server=FedHProServer,
    client=FedHProClient,
    description=DESCRIPTION,
    recipes={"authors": AUTHORS_RECIPE},
)
