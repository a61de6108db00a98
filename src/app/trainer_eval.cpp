// Evaluator: loss and top-1 / top-5 over the eval split, evaluate_only() and predict() (the
// logits of every eval sample written to predictions.h5).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "trainer_impl.h"
#include "vitgrid/core/watchdog.h"

namespace vitgrid {
namespace trainer_detail {

using trainer_util::mkdirs;

// Called by all ranks: the loss (or any sums) known on the last stage, on every stage.
void Evaluator::from_last_stage(double* v, int n) {
  const int P = run_.grid->size(Axis::Pipeline);
  if (P == 1) return;
  WatchdogWait w("an MPI broadcast from the last stage", "pipeline");
  MPI_Bcast(v, n, MPI_DOUBLE, P - 1, run_.grid->comm(Axis::Pipeline).get());
}

// ---- evaluation over the eval split; returns loss, top1, top5 (fractions)
void Evaluator::evaluate(double* loss, double* top1, double* top5,
                         std::vector<std::pair<int64_t, std::vector<float>>>* rows) {
  const ProcessGrid& grid = *run_.grid;
  PipelineRunner& pipe = *run_.pipe;
  // eval's kernels are timed by each rank alone: the last eval batch has a different number
  // of samples (so different GEMM shapes) on each data rank
  run_.be->set_tune_agreement(nullptr);
  ParamGather* gather = run_.gather.get();
  if (gather) gather->gather_now(run_.model->compute_copy());  // the last update's, all of them
  DataLoader loader(run_.eval_ds, in_.loader_config(false));
  Inputs::LoaderScope bound(in_, loader);
  double s[4] = {0, 0, 0, 0};
  int64_t t = 0;
  const int64_t E = run_.deck.data.global_batch / run_.deck.data.grad_accum;
  while (auto hb = loader.next()) {
    DeviceBatch db = in_.upload(*hb);
    double l = 0, c1 = 0, c5 = 0;
    std::vector<float> logits;
    const bool want_rows = rows && pipe.last_stage();
    pipe.eval(db, &l, &c1, &c5, want_rows ? &logits : nullptr);
    s[0] += l;
    s[1] += c1;
    s[2] += c5;
    s[3] += hb->count;
    if (want_rows && hb->count > 0) {
      const int K = run_.cfg.classes;
      const int64_t first = t * E + int64_t(grid.rank(Axis::Data)) * run_.b;
      for (int i = 0; i < hb->count; ++i) {
        std::vector<float> r(logits.begin() + int64_t(i) * K, logits.begin() + int64_t(i + 1) * K);
        r.push_back(static_cast<float>(hb->labels[i]));
        rows->emplace_back(first + i, std::move(r));
      }
    }
    ++t;
  }
  WatchdogWait w("the MPI all-reduce of the evaluation sums", "data");
  MPI_Allreduce(MPI_IN_PLACE, s, 4, MPI_DOUBLE, MPI_SUM, grid.comm(Axis::Data).get());
  from_last_stage(s, 3);  // the sums are known on the last stage; the counts everywhere
  const double n = std::max(s[3], 1.0);
  *loss = s[0] / n;
  *top1 = s[1] / n;
  *top5 = s[2] / n;
  // FP8: the evaluation's casts recorded amaxes; the training scales come from training's
  if (run_.model->fp8()) run_.model->fp8_discard_amaxes();
  run_.be->set_tune_agreement(run_.tune_agreement);
}

// After setup and the load of checkpoint.load: one evaluation, one log line.
int Evaluator::evaluate_only() {
  double el, e1, e5;
  evaluate(&el, &e1, &e5);
  run_.log("eval %s | loss %.4f | top-1 %.2f%% | top-5 %.2f%%\n",
           run_.deck.checkpoint.load.c_str(), el, 100 * e1, 100 * e5);
  return 0;
}

// After setup and the load of checkpoint.load: the logits of every eval sample written to
// run.out_dir/predictions.h5.
int Evaluator::predict() {
  const Deck& deck = run_.deck;
  const ProcessGrid& grid = *run_.grid;
  std::vector<std::pair<int64_t, std::vector<float>>> rows;
  double el, e1, e5;
  evaluate(&el, &e1, &e5, &rows);
  // Rows come interleaved over data ranks (eval batches are split across them); move them
  // so that data rank r holds the contiguous block [r*chunk, (r+1)*chunk) and write those
  // hyperslabs collectively. Ranks outside tensor/pipeline coordinate 0 hold copies.
  const MPI_Comm dc = grid.comm(Axis::Data).get();
  const int D = grid.size(Axis::Data), r = grid.rank(Axis::Data);
  int64_t total = static_cast<int64_t>(rows.size());
  MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_INT64_T, MPI_SUM, dc);
  const int64_t chunk = (total + D - 1) / D;
  const int K = run_.cfg.classes, W = K + 2;  // position, K logits, label
  std::vector<std::vector<double>> out(D);
  for (auto& [pos, v] : rows) {
    auto& o = out[std::min<int64_t>(pos / chunk, D - 1)];
    o.push_back(double(pos));
    o.insert(o.end(), v.begin(), v.end());
  }
  std::vector<int> sc(D), rc(D), sd(D), rd(D);
  std::vector<double> sbuf;
  for (int i = 0; i < D; ++i) {
    sd[i] = static_cast<int>(sbuf.size());
    sc[i] = static_cast<int>(out[i].size());
    sbuf.insert(sbuf.end(), out[i].begin(), out[i].end());
  }
  MPI_Alltoall(sc.data(), 1, MPI_INT, rc.data(), 1, MPI_INT, dc);
  int rtot = 0;
  for (int i = 0; i < D; ++i) {
    rd[i] = rtot;
    rtot += rc[i];
  }
  std::vector<double> rbuf(rtot);
  MPI_Alltoallv(sbuf.data(), sc.data(), sd.data(), MPI_DOUBLE, rbuf.data(), rc.data(),
                rd.data(), MPI_DOUBLE, dc);
  const int64_t nrows = rtot / W, first = std::min<int64_t>(int64_t(r) * chunk, total);
  std::vector<float> logits(nrows * K);
  std::vector<int32_t> labels(nrows);
  for (int64_t i = 0; i < nrows; ++i) {
    const double* row = rbuf.data() + i * W;
    const int64_t at = static_cast<int64_t>(row[0]) - first;
    for (int k = 0; k < K; ++k) logits[at * K + k] = static_cast<float>(row[1 + k]);
    labels[at] = static_cast<int32_t>(row[1 + K]);
  }
  if (grid.world_rank() == 0) mkdirs(deck.run.out_dir);
  MPI_Barrier(run_.world);
  // The logits are on the last stage, alike on its tensor ranks: one data group writes.
  if (run_.pipe->last_stage() && grid.rank(Axis::Tensor) == 0)
    write_predictions(dc, deck.run.out_dir + "/predictions.h5", deck.resolved_text(), total,
                      K, first, logits, labels);
  MPI_Barrier(run_.world);
  double rows_written = static_cast<double>(total);
  from_last_stage(&rows_written, 1);
  run_.log("predict %s: %lld rows written to %s/predictions.h5 (top-1 %.2f%%)\n",
           deck.checkpoint.load.c_str(), static_cast<long long>(rows_written),
           deck.run.out_dir.c_str(), 100 * e1);
  return 0;
}

}  // namespace trainer_detail
}  // namespace vitgrid
