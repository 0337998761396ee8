import sys

from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from shared.service.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("gateway", GatewayConfig, GatewayService))
