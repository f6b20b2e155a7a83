import sys

from rlvr_lightning.console import quiet_libraries

if __name__ == "__main__":
    sys.argv[1:] = quiet_libraries(sys.argv[1:])  # before torch, Lightning and vLLM read their settings at import
    from rlvr_lightning.cli import main

    main()
