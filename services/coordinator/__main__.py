from services.coordinator.server import main

main()
