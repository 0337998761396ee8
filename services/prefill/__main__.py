import sys

from moemesh.services.prefill.config import PrefillConfig
from moemesh.services.prefill.service import PrefillService
from moemesh.shared.service.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("prefill", PrefillConfig, PrefillService))
