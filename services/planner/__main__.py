from services.planner.server import main

main()
