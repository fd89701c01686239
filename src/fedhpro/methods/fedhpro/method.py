"""FedHPro's entry in the method registry: its declaration (options, recipe, description), server and client
under the name ``fedhpro``."""

from __future__ import annotations

from fedhpro.methods.base import MethodSpec
from fedhpro.methods.fedhpro.client import FedHProClient
from fedhpro.methods.fedhpro.options import DECLARATION
from fedhpro.methods.fedhpro.server import FedHProServer

METHOD = MethodSpec.from_declaration(DECLARATION, server=FedHProServer, client=FedHProClient)
