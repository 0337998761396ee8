import sys

from moemesh.services.balancer.config import BalancerConfig
from moemesh.services.balancer.service import BalancerService
from moemesh.shared.service.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("balancer", BalancerConfig, BalancerService))
