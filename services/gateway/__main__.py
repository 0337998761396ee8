import sys

from moemesh.services.gateway.config import GatewayConfig
from moemesh.services.gateway.service import GatewayService
from moemesh.shared.service.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("gateway", GatewayConfig, GatewayService))
