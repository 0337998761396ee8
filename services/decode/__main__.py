import sys

from services.decode.config import DecodeConfig
from services.decode.service import DecodeService
from shared.service.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("decode", DecodeConfig, DecodeService))
