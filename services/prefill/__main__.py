import sys

from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService
from shared.service.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("prefill", PrefillConfig, PrefillService))
