import sys

from services.balancer.config import BalancerConfig
from services.balancer.service import BalancerService
from shared.service.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("balancer", BalancerConfig, BalancerService))
