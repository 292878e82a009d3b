from services.sidecar.server import main

main()
