#include "vitgrid/app/app.h"

#include <mpi.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "vitgrid/app/trainer.h"
#include "vitgrid/core/error.h"
#include "vitgrid/core/log.h"
#include "vitgrid/deck/deck.h"

namespace vitgrid {
namespace {

const char* kUsage =
    "usage: vitgrid train   DECK [--section.key=value ...]\n"
    "       vitgrid eval    DECK --checkpoint.load=PATH [--section.key=value ...]\n"
    "       vitgrid predict DECK --checkpoint.load=PATH   (writes RUN_DIR/predictions.h5)\n"
    "       vitgrid bench   DECK [--warmup=N] [--steps=N] [--peak-tflops=X] [--profile]\n"
    "                       [--checkpoint] [overrides]\n"
    "       vitgrid help-deck    (every deck key, its type, default and meaning)\n"
    "       vitgrid version\n";

}  // namespace

int run_app(int argc, char** argv) {
  MPI_Comm world = MPI_COMM_WORLD;
  open_error_channel(world);
  // An exception that escapes anyway (a thread's, a noexcept function's) is reported like a
  // local fatal error, not with std::terminate's "terminate called" and a backtrace.
  std::set_terminate([] {
    std::string what = "an unhandled exception";
    if (auto e = std::current_exception()) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        what = x.what();
      } catch (...) {
      }
    }
    fail_one(__FILE__, __LINE__, "unhandled: " + what);
  });
  Log log(world);
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    log("%s", kUsage);
    return kExitUserError;
  }
  const std::string cmd = args[0];
  if (cmd == "help-deck") {
    log.block(deck_reference());
    return 0;
  }
  if (cmd == "version" || cmd == "--version") {
    log("vitgrid 0.1.0\n");
    return 0;
  }
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    log("%s", kUsage);
    return 0;
  }
  if (cmd != "train" && cmd != "eval" && cmd != "predict" && cmd != "bench") {
    log("vitgrid: error: unknown command '%s'\n%s", cmd.c_str(), kUsage);
    return kExitUserError;
  }
  // `vitgrid train --help` (anywhere after the command): the usage, exit 0
  if (std::find(args.begin() + 1, args.end(), "--help") != args.end() ||
      std::find(args.begin() + 1, args.end(), "-h") != args.end()) {
    log("%s", kUsage);
    return 0;
  }
  if (args.size() < 2 || args[1].rfind("--", 0) == 0) {
    log("vitgrid: error: '%s' needs a deck file\n%s", cmd.c_str(), kUsage);
    return kExitUserError;
  }
  int world_size = 1;
  MPI_Comm_size(world, &world_size);
  // Every rank parses the same deck; agree anyway so that one message is printed and every
  // rank exits with the same code.
  // bench options (not deck keys)
  int warmup = 5, steps = 20;
  double peak = 0.0;
  bool profile = false, checkpoint = false;
  for (auto it = args.begin() + 2; it != args.end();) {
    auto opt = [&](const char* name, auto& v) {
      const std::string p = std::string("--") + name + "=";
      if (it->rfind(p, 0) != 0) return false;
      std::istringstream is(it->substr(p.size()));
      is >> v;
      return true;
    };
    if (cmd == "bench" && (opt("warmup", warmup) || opt("steps", steps) || opt("peak-tflops", peak)))
      it = args.erase(it);
    else if (cmd == "bench" && *it == "--profile")
      profile = true, it = args.erase(it);
    else if (cmd == "bench" && *it == "--checkpoint")
      checkpoint = true, it = args.erase(it);
    else
      ++it;
  }
  Deck deck;
  std::string msg;
  bool ok = true;
  try {
    std::vector<std::string> overrides(args.begin() + 2, args.end());
    deck = parse_deck(args[1], overrides, world_size);
    // train writes metrics and checkpoints, predict predictions.h5; eval and bench nothing.
    // One rank tries run.out_dir for real (the others learn its verdict below): one file
    // created in it at any scale, not one per rank.
    int world_rank = 0;
    MPI_Comm_rank(world, &world_rank);
    check_deck_paths(deck, cmd == "train", (cmd == "train" || cmd == "predict") && world_rank == 0);
    if ((cmd == "eval" || cmd == "predict") && deck.checkpoint.load.empty())
      throw UserError("checkpoint.load: '" + cmd + "' needs a checkpoint (--checkpoint.load=PATH)");
  } catch (const UserError& e) {
    ok = false;
    msg = e.what();
  }
  if (agree_error(world, ok, &msg)) fail_all(world, msg);
  // From here on, an error that the code below does not settle where it happens (a
  // UserError thrown alike on every rank, a failure one rank alone saw, a std::exception of
  // the standard library) unwinds to here: fail_agreed ends the job with one message and the
  // same exit code on every rank, never a std::terminate.
  try {
    Trainer trainer(world, deck);
    if (cmd == "train") return trainer.train();
    if (cmd == "eval") return trainer.evaluate_only();
    if (cmd == "bench") return trainer.bench(warmup, steps, peak, profile, checkpoint);  // peak 0: not given
    return trainer.predict();
  } catch (const UserError& e) {
    fail_agreed(e.what(), kExitUserError);
  } catch (const std::bad_alloc&) {
    fail_agreed(
        "out of host memory (std::bad_alloc): the deck asks for more memory than this "
        "node has; reduce data.global_batch, the model or the dataset",
        kExitUserError);
  } catch (const std::exception& e) {
    fail_agreed(std::string("internal error: ") + e.what(), 1);
  }
}

}  // namespace vitgrid
