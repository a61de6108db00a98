// The loader over encoded images (JPEG sources): the three sources give identical batches for
// the same images, every layout (data ranks x accumulation) sees the same samples, views,
// mixing and soft targets, undecodable images are replaced the same way everywhere, and views
// left for the device decode on the host to the same pixels.
//
// Data: test/data/make_jpeg_tree.py writes an ImageFolder tree (with grayscale, CMYK,
// progressive, 4:4:4, 4:2:2, PNG-named-.JPEG and, for the bad-data case, a truncated file);
// test/data/write_tfrecord.py writes the same images as TFRecord shards (protobuf + crcmod, no
// vitgrid code); h5py writes them as a jpeg_h5 pair (the documented layout).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "vitgrid/backend/image_decoder.h"
#include "vitgrid/core/error.h"
#include "vitgrid/data/dataset.h"
#include "vitgrid/data/image_source.h"
#include "vitgrid/data/image_transform.h"

using vitgrid::DataLoader;
using vitgrid::Dataset;
using vitgrid::HostBatch;
using vitgrid::LoaderConfig;

namespace {

constexpr int kS = 32, kClasses = 3;

std::string env(const char* k, const char* dflt) {
  const char* v = std::getenv(k);
  return v && *v ? v : dflt;
}

class EncodedLoader : public ::testing::Test {
 protected:
  static std::string dir_;
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/vg_encoded_XXXXXX";
    dir_ = mkdtemp(tmpl);
    const std::string py = env("VG_PYTHON3", "/usr/bin/python3");
    const std::string src = env("VITGRID_SOURCE_DIR", VG_SOURCE_DIR);
    auto run = [](const std::string& c) {
      if (std::system(c.c_str()) != 0) throw std::runtime_error("failed: " + c);
    };
    run(py + " " + src + "/test/data/make_jpeg_tree.py " + dir_ + "/tree --classes 3 --train 10 --val 4 --no-bad");
    run(py + " " + src + "/test/data/make_jpeg_tree.py " + dir_ + "/bad --classes 3 --train 10 --val 4 --bad");
    run(py + " " + src + "/test/data/write_tfrecord.py " + dir_ + "/tree " + dir_ + "/tfr --shards 3");
    // jpeg_h5 with h5py: the layout of include/vitgrid/data/image_source.h, written here
    // independently of vitgrid_dataset pack
    const std::string pack =
        "import h5py, numpy as np, os, sys\n"
        "root, out = sys.argv[1], sys.argv[2]\n"
        "classes = sorted(os.listdir(os.path.join(root, 'train')))\n"
        "for split, name in (('train', '_train.h5'), ('val', '_val.h5')):\n"
        "    data, labels = [], []\n"
        "    for k, c in enumerate(classes):\n"
        "        for f in sorted(os.listdir(os.path.join(root, split, c))):\n"
        "            data.append(open(os.path.join(root, split, c, f), 'rb').read()); labels.append(k)\n"
        "    off = np.cumsum([0] + [len(d) for d in data]).astype(np.int64)\n"
        "    with h5py.File(out + name, 'w') as h:\n"
        "        h.create_dataset('jpeg', data=np.frombuffer(b''.join(data), np.uint8))\n"
        "        h.create_dataset('offsets', data=off)\n"
        "        h.create_dataset('labels', data=np.array(labels, np.int64))\n"
        "        h.create_dataset('classes', data=np.array(classes, dtype=h5py.string_dtype()))\n"
        "        h.attrs['num_classes'] = len(classes); h.attrs['source'] = root\n";
    FILE* f = std::fopen((dir_ + "/pack.py").c_str(), "w");
    std::fputs(pack.c_str(), f);
    std::fclose(f);
    run(py + " " + dir_ + "/pack.py " + dir_ + "/tree " + dir_ + "/packed");
  }
  static void TearDownTestSuite() { std::system(("rm -rf " + dir_).c_str()); }

  static std::shared_ptr<Dataset> open(const std::string& kind, bool train = true,
                                       const std::string& tree = "tree") {
    vitgrid::ImageSourceOptions o;
    o.train = train;
    o.num_classes = kClasses;
    o.index_dir = dir_ + "/index";
    std::unique_ptr<vitgrid::ImageSource> s;
    if (kind == "folder") s = vitgrid::open_image_folder(dir_ + "/" + tree, o);
    if (kind == "tfrecord") {
      o.label_offset = -1;
      for (int part = 0; part < 2; ++part)
        vitgrid::tfrecord_build_indexes(dir_ + "/tfr", o.index_dir, train, part, 2);
      s = vitgrid::open_tfrecord(dir_ + "/tfr", o);
    }
    if (kind == "jpeg_h5") s = vitgrid::open_jpeg_h5(dir_ + "/packed.h5", o);
    return vitgrid::make_encoded_dataset(std::move(s), kS, 1, 0.875);
  }

  static LoaderConfig cfg(int64_t G, int A, int D, int r) {
    LoaderConfig c;
    c.seed = 99;
    c.global_batch = G;
    c.grad_accum = A;
    c.data_size = D;
    c.data_rank = r;
    c.hflip = true;
    c.num_classes = kClasses;
    c.workers = 2;
    c.mix.mixup_alpha = 0.8;
    c.mix.cutmix_alpha = 1.0;
    c.mix.mode = vitgrid::MixMode::Pair;
    return c;
  }
};
std::string EncodedLoader::dir_;

std::string image_of(const HostBatch& hb, int j) {
  const size_t n = (size_t)kS * kS * 3;
  return std::string(hb.images.begin() + j * n, hb.images.begin() + (j + 1) * n);
}

}  // namespace

TEST_F(EncodedLoader, ThreeSourcesGiveIdenticalBatches) {
  auto folder = open("folder"), tfr = open("tfrecord"), h5 = open("jpeg_h5");
  ASSERT_EQ(folder->size(), 30);
  EXPECT_EQ(tfr->size(), 30);
  EXPECT_EQ(h5->size(), 30);
  DataLoader a(folder, cfg(8, 1, 1, 0)), b(tfr, cfg(8, 1, 1, 0)), c(h5, cfg(8, 1, 1, 0));
  for (int k = 0; k < 8; ++k) {  // 64 positions: every image at least twice, crossing epochs
    auto x = a.next(), y = b.next(), z = c.next();
    EXPECT_EQ(x->labels, y->labels);
    EXPECT_EQ(x->labels, z->labels);
    EXPECT_TRUE(x->images == y->images && x->images == z->images) << "batch " << k;
    EXPECT_EQ(x->soft, y->soft);
    EXPECT_EQ(x->soft, z->soft);
    EXPECT_EQ(x->bad, 0);
  }
  // the eval split too (the eval view: resize + centre crop)
  auto fe = open("folder", false), te = open("tfrecord", false), he = open("jpeg_h5", false);
  ASSERT_EQ(fe->size(), 12);
  auto ec = cfg(8, 1, 1, 0);
  ec.train = false;
  DataLoader ea(fe, ec), eb(te, ec), ee(he, ec);
  while (auto x = ea.next()) {
    auto y = eb.next(), z = ee.next();
    ASSERT_TRUE(y && z);
    EXPECT_EQ(x->labels, y->labels);
    EXPECT_TRUE(x->images == y->images && x->images == z->images);
  }
}

// Every (data ranks, accumulation) layout delivers the same samples at the same stream
// positions: the same view pixels, labels, partners and soft targets.
TEST_F(EncodedLoader, LayoutIndependent) {
  auto ds = open("folder");
  const int64_t G = 16;
  using Key = std::tuple<int64_t, int32_t, int64_t, size_t>;  // pos, label, partner pos, hash
  auto collect = [&](int D, int A) {
    std::set<Key> keys;
    for (int r = 0; r < D; ++r) {
      DataLoader dl(ds, cfg(G, A, D, r));
      for (int s = 0; s < 3; ++s)
        for (int m = 0; m < A; ++m) {
          auto hb = dl.next();
          for (int j = 0; j < hb->count; ++j) {
            const auto& a = hb->aug[j];
            std::string bytes = image_of(*hb, j);
            bytes.append(reinterpret_cast<const char*>(&hb->soft[j * kClasses]), kClasses * 4);
            const float f[] = {float(a.dx), float(a.dy), float(a.flip), a.lam, a.target_lam,
                               float(a.cut_x0), float(a.cut_y0), float(a.cut_x1), float(a.cut_y1)};
            bytes.append(reinterpret_cast<const char*>(f), sizeof(f));
            keys.insert(Key{hb->first_position + j, hb->labels[j],
                            a.partner < 0 ? -1 : hb->first_position + a.partner,
                            std::hash<std::string>()(bytes)});
          }
        }
    }
    return keys;
  };
  auto ref = collect(1, 1);
  ASSERT_EQ(ref.size(), 3u * G);
  EXPECT_EQ(collect(4, 1), ref);
  EXPECT_EQ(collect(2, 2), ref);
  EXPECT_EQ(collect(2, 4), ref);
}

// A truncated JPEG is replaced by the next decodable image, with the same position's crop, on
// every layout, and counted.
TEST_F(EncodedLoader, UndecodableImagesAreReplacedTheSameWayEverywhere) {
  auto bad = open("folder", true, "bad");
  ASSERT_EQ(bad->size(), 30);
  auto run = [&](int D) {
    std::map<int64_t, std::string> seen;
    int replaced = 0;
    for (int r = 0; r < D; ++r) {
      auto c = cfg(10, 1, D, r);
      c.mix = vitgrid::MixConfig();
      DataLoader dl(bad, c);
      for (int s = 0; s < 6; ++s) {  // 60 positions: two epochs, each holding the bad file
        auto hb = dl.next();
        replaced += hb->bad;
        for (int j = 0; j < hb->count; ++j)
          seen[hb->first_position + j] = image_of(*hb, j) + std::to_string(hb->labels[j]);
      }
    }
    return std::make_pair(seen, replaced);
  };
  auto one = run(1), two = run(2);
  EXPECT_EQ(one.second, 2);  // once per epoch
  EXPECT_EQ(two.second, 2);
  EXPECT_EQ(one.first, two.first);
}

// With a device decoder, the views it takes carry their bytes, box and flip: decoding them on
// the host (DataLoader::decode_on_host, the fallback) gives the all-host loader's pixels.
TEST_F(EncodedLoader, DeviceViewsDecodeOnTheHostToTheSamePixels) {
  auto ds = open("folder");
  auto host_cfg = cfg(10, 1, 1, 0), dev_cfg = host_cfg;
  host_cfg.real.dct_scale = dev_cfg.real.dct_scale = false;
  int taken = 0, offered = 0;
  dev_cfg.real.device_accepts = [&](int comps, bool progressive, int, int) {
    ++offered;
    return comps == 3 && !progressive;
  };
  DataLoader host(ds, host_cfg), dev(ds, dev_cfg);
  for (int k = 0; k < 3; ++k) {
    auto h = host.next(), d = dev.next();
    EXPECT_EQ(h->labels, d->labels);
    std::set<int> slots;
    for (const auto& v : d->views) {
      ++taken;
      slots.insert(v.slot);
      ASSERT_LE(v.offset + v.size, d->encoded.size());
      std::vector<uint8_t> out((size_t)kS * kS * 3);
      int bad = 0;
      EXPECT_EQ(dev.decode_on_host(v, out.data(), &bad), d->labels[v.slot]);
      EXPECT_EQ(bad, 0);
      EXPECT_EQ(std::string(out.begin(), out.end()), image_of(*h, v.slot)) << "slot " << v.slot;
    }
    for (int j = 0; j < d->count; ++j)  // the rest was decoded on the host, as before
      if (!slots.count(j)) {
        EXPECT_EQ(image_of(*d, j), image_of(*h, j));
      }
  }
  EXPECT_GT(taken, 0);
  EXPECT_GT(offered, taken);  // grayscale, CMYK, progressive and PNG stay on the host
}

// data.device_share: the device is offered the images at the positions device_turn() picks
// (a share of them, spread evenly, independent of the layout); the loader's threads decode the
// others, to the all-host loader's pixels.
TEST_F(EncodedLoader, DeviceShareOffersThePositionsItPicks) {
  for (double share : {0.0, 0.3, 0.5, 1.0}) {  // any window of n positions: round(share n) +- 1
    for (int64_t first : {0, 7, 1000003}) {
      for (int n : {1, 10, 97}) {
        int k = 0;
        for (int64_t p = first; p < first + n; ++p) k += vitgrid::device_turn(share, p) ? 1 : 0;
        EXPECT_LE(std::abs(k - share * n), 1.0) << share << " " << first << " " << n;
      }
    }
  }
  auto ds = open("folder");
  auto host_cfg = cfg(10, 1, 1, 0);
  host_cfg.real.dct_scale = false;
  DataLoader host(ds, host_cfg);
  std::vector<std::shared_ptr<const HostBatch>> ref;
  for (int k = 0; k < 3; ++k) ref.push_back(host.next());
  std::map<double, int> taken;
  for (double share : {0.0, 0.25, 1.0}) {
    auto dev_cfg = host_cfg;
    dev_cfg.real.device_share = share;
    dev_cfg.real.device_accepts = [](int comps, bool progressive, int, int) {
      return comps == 3 && !progressive;
    };
    DataLoader dev(ds, dev_cfg);
    for (int k = 0; k < 3; ++k) {
      auto d = dev.next();
      const HostBatch& h = *ref[k];
      EXPECT_EQ(h.labels, d->labels);
      std::set<int> slots;
      for (const auto& v : d->views) {
        ++taken[share];
        slots.insert(v.slot);
        EXPECT_TRUE(vitgrid::device_turn(share, v.position)) << "share " << share;
        std::vector<uint8_t> out((size_t)kS * kS * 3);
        int bad = 0;
        dev.decode_on_host(v, out.data(), &bad);
        EXPECT_EQ(std::string(out.begin(), out.end()), image_of(h, v.slot));
      }
      for (int j = 0; j < d->count; ++j)
        if (!slots.count(j)) {
          EXPECT_EQ(image_of(*d, j), image_of(h, j)) << "share " << share << " slot " << j;
        }
    }
  }
  EXPECT_EQ(taken[0.0], 0);
  EXPECT_GT(taken[0.25], 0);
  EXPECT_LT(taken[0.25], taken[1.0] / 2);  // a quarter of the positions, of those it accepts
}

namespace {

// An ImageDecoder on host memory, for the CPU: it "decodes" a view with a loader's host path
// when join() is called, refuses the bitstreams that path cannot decode (as nvJPEG refuses a
// corrupt one) and, to exercise the plain fallback, every third job as well.
class HostFakeDecoder final : public vitgrid::ImageDecoder {
 public:
  HostFakeDecoder(DataLoader& decoder_loader, const HostBatch*& batch)
      : loader_(decoder_loader), batch_(batch) {}
  bool accepts(int, bool, int, int) const override { return true; }
  void decode_async(const vitgrid::DecodeJob* jobs, int n, int S, int, uint8_t* out) override {
    for (int k = 0; k < n; ++k) pending_.push_back({jobs[k].slot, S, out, nullptr});
  }
  void copy_async(const uint8_t* const* host, const int* slots, int n, int S, uint8_t* out) override {
    for (int k = 0; k < n; ++k) pending_.push_back({slots[k], S, out, host[k]});
  }
  // boxes up to max_box_ pixels wide and high (the device's filter bound, made small)
  bool resizes(double w, double h, int, int) const override {
    return w <= max_box_ && h <= max_box_;
  }
  // the host's resample of each region (the CUDA kernels' reference), at once
  void resize_async(const vitgrid::HostRegion* r, int n, int S, int interp, uint8_t* out) override {
    for (int k = 0; k < n; ++k) {
      const vitgrid::HostRegion& g = r[k];
      EXPECT_LE(std::max(g.bx1 - g.bx0, g.by1 - g.by0), max_box_ + 1.0);
      const vitgrid::Box box{g.bx0, g.by0, g.bx1, g.by1, static_cast<vitgrid::BoxMode>(g.mode)};
      vitgrid::resample_part(g.pixels, (int)g.stride, g.x0, g.y0, g.w, g.h, g.W, g.H, box, S, S,
                             static_cast<vitgrid::Interp>(interp), g.flip != 0,
                             out + (size_t)g.slot * S * S * 3, scratch_);
      ++resized_;
    }
  }
  double max_box_ = 1e9;
  int resized_ = 0;
  std::vector<int> join() override {
    std::vector<int> refused;
    for (const Work& w : pending_) {
      const size_t img = (size_t)w.S * w.S * 3;
      uint8_t* dst = w.out + w.slot * img;
      if (w.host) {
        std::copy(w.host, w.host + img, dst);
        continue;
      }
      const vitgrid::EncodedView* v = nullptr;
      for (const auto& e : batch_->views)
        if (e.slot == w.slot) v = &e;
      if (!v) throw std::logic_error("a job for a slot without a view");
      std::vector<uint8_t> tmp(img);
      int bad = 0;
      loader_.decode_on_host(*v, tmp.data(), &bad);
      if (bad || ++jobs_ % 3 == 0) {
        refused.push_back(w.slot);
        continue;
      }
      std::copy(tmp.begin(), tmp.end(), dst);
    }
    pending_.clear();
    std::sort(refused.begin(), refused.end());
    return refused;
  }
  std::string describe() const override { return "host fake"; }

 private:
  struct Work {
    int slot, S;
    uint8_t* out;
    const uint8_t* host;
  };
  DataLoader& loader_;
  const HostBatch*& batch_;
  std::vector<Work> pending_;
  int jobs_ = 0;
  vitgrid::ResampleScratch scratch_;
};

}  // namespace

// The device path's bookkeeping (data/device_decode.cpp) with a decoder that refuses views:
// the refused ones are decoded on the host, a truncated file is replaced as the all-host loader
// replaces it, and the labels and soft targets handed back for re-upload are the all-host
// loader's. Every image of the batch ends up as the all-host loader's.
TEST_F(EncodedLoader, RefusedDeviceViewsEndAsTheHostLoadersBatch) {
  // the truncated JPEG ends with an EOI marker here, so the loader offers it to the device,
  // which refuses it, as nvJPEG refuses a corrupt bitstream that passed the header checks
  namespace fs = std::filesystem;
  const fs::path tree = fs::path(dir_) / "bad_eoi";
  fs::remove_all(tree);
  fs::copy(fs::path(dir_) / "bad", tree, fs::copy_options::recursive);
  int cut = 0;
  for (const auto& e : fs::recursive_directory_iterator(tree / "train")) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    const std::string b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (b.size() < 4 || b.compare(0, 2, "\xff\xd8") != 0 || b.compare(b.size() - 2, 2, "\xff\xd9") == 0)
      continue;
    std::ofstream(e.path(), std::ios::binary | std::ios::app) << "\xff\xd9";
    ++cut;
  }
  ASSERT_EQ(cut, 1);
  {  // and the last image of the first class is cut the same way: its replacement (the next
     // index) is of the second class, so labels and soft targets must follow
    std::vector<fs::path> first_class;
    for (const auto& e : fs::directory_iterator(tree / "train" / "n00001000")) first_class.push_back(e.path());
    std::sort(first_class.begin(), first_class.end());
    ASSERT_FALSE(first_class.empty());
    std::ifstream in(first_class.back(), std::ios::binary);
    std::string b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    in.close();
    ASSERT_EQ(b.compare(0, 2, "\xff\xd8"), 0);
    b = b.substr(0, b.size() / 2) + "\xff\xd9";
    std::ofstream(first_class.back(), std::ios::binary | std::ios::trunc) << b;
  }
  auto bad = open("folder", true, "bad_eoi");
  auto host_cfg = cfg(10, 1, 1, 0), dev_cfg = host_cfg;
  host_cfg.real.dct_scale = dev_cfg.real.dct_scale = false;
  dev_cfg.real.device_accepts = [](int, bool, int, int) { return true; };
  DataLoader host(bad, host_cfg), dev(bad, dev_cfg), fake_side(bad, dev_cfg);
  const HostBatch* current = nullptr;
  HostFakeDecoder dec(fake_side, current);
  int64_t replaced = 0, relabelled = 0, views = 0, host_replaced = 0;
  for (int s = 0; s < 12; ++s) {  // 120 positions: four epochs, each holding the truncated file
    auto h = host.next(), d = dev.next();
    current = d.get();
    host_replaced += h->bad;
    replaced += d->bad;  // replacements the device loader made on the host, if any
    views += (int64_t)d->views.size();
    std::vector<uint8_t> out((size_t)d->count * kS * kS * 3, 0);
    vitgrid::decode_batch_on_device(dec, *d, kS, 0, out.data());
    std::vector<int32_t> labels = d->labels;
    std::vector<float> soft = d->soft;
    vitgrid::finish_batch_on_device(
        dec, dev, *d, kS, kClasses, out.data(), &replaced,
        [&](const std::vector<int32_t>& l, const std::vector<float>& f) {
          ++relabelled;
          labels = l;
          soft = f;
        });
    EXPECT_EQ(labels, h->labels) << "step " << s;
    ASSERT_EQ(soft.size(), h->soft.size());
    for (size_t i = 0; i < soft.size(); ++i) ASSERT_EQ(soft[i], h->soft[i]) << "step " << s << " " << i;
    for (int j = 0; j < d->count; ++j) EXPECT_EQ(image_of(*h, j), std::string(out.begin() + j * kS * kS * 3, out.begin() + (j + 1) * kS * kS * 3)) << "step " << s << " slot " << j;
  }
  EXPECT_GT(views, 60);           // most images went to the "device"
  // the two cut files, once per epoch each, except where the crop lies above the cut (the host
  // decodes only the rows it needs): the same on both paths
  EXPECT_GT(host_replaced, 3);
  EXPECT_EQ(replaced, host_replaced);
  EXPECT_GT(relabelled, 0);       // at least one replacement came from another class
}

// data.resize = device: the loader's threads decode only the region each view's resize reads
// (HostBatch::regions, their pixels in per-thread buffers), the "device" resamples it (here the
// host's resample_part, which the CUDA kernels equal bit for bit: test/gpu/test_gpu_jpeg.cpp).
// Train (RandomResizedCrop + flip, Mixup/CutMix) and eval (resize + centre crop) batches end as
// the all-host loader's, with some views left to the device's decoder, some boxes too large for
// the "device" resized on the host, and the truncated file replaced as the host replaces it.
TEST_F(EncodedLoader, DeviceResizedRegionsEndAsTheHostLoadersBatch) {
  for (const char* tree : {"tree", "bad"}) {
    for (bool train : {true, false}) {
      auto ds = open("folder", train, tree);
      auto host_cfg = cfg(10, 1, 1, 0);
      host_cfg.train = train;
      host_cfg.real.dct_scale = train && std::string(tree) == "tree";  // and 1/2-scale decodes
      auto dev_cfg = host_cfg;
      const HostBatch* current = nullptr;
      DataLoader host(ds, host_cfg), fake_side(ds, dev_cfg);
      HostFakeDecoder dec(fake_side, current);
      dec.max_box_ = train ? 60 : 100;
      dev_cfg.real.device_resizes = [&dec](double w, double h) { return dec.resizes(w, h, kS, 1); };
      dev_cfg.real.device_accepts = [](int comps, bool progressive, int, int) {
        return comps == 3 && !progressive;
      };
      dev_cfg.real.device_share = 0.25;
      DataLoader dev(ds, dev_cfg);
      int64_t regions = 0, views = 0, host_resized = 0, host_bad = 0, dev_bad = 0;
      for (int s = 0; s < (train ? 9 : 2); ++s) {
        auto h = host.next(), d = dev.next();
        if (!h) {
          EXPECT_FALSE(d);
          break;
        }
        ASSERT_TRUE(d);
        current = d.get();
        host_bad += h->bad;
        dev_bad += d->bad;
        EXPECT_EQ(h->labels, d->labels);
        EXPECT_EQ(h->soft, d->soft);
        std::set<int> slots;
        for (const auto& dr : d->regions) {
          const vitgrid::HostRegion& r = dr.region;
          EXPECT_TRUE(slots.insert(r.slot).second);
          ASSERT_LT(dr.part, (int)d->pixels.size());
          ASSERT_GE(r.stride, (size_t)r.w * 3);
          ASSERT_LE(dr.offset + r.stride * (r.h - 1) + (size_t)r.w * 3, d->pixels[dr.part].size());
        }
        for (const auto& v : d->views) EXPECT_TRUE(slots.insert(v.slot).second);
        regions += (int64_t)d->regions.size();
        views += (int64_t)d->views.size();
        host_resized += d->count - (int64_t)slots.size();
        std::vector<uint8_t> out((size_t)d->count * kS * kS * 3, 0);
        vitgrid::decode_batch_on_device(dec, *d, kS, 1, out.data());
        int64_t replaced = 0;
        vitgrid::finish_batch_on_device(
            dec, dev, *d, kS, kClasses, out.data(), &replaced,
            [](const std::vector<int32_t>&, const std::vector<float>&) {});
        for (int j = 0; j < d->count; ++j)
          EXPECT_EQ(image_of(*h, j),
                    std::string(out.begin() + j * kS * kS * 3, out.begin() + (j + 1) * kS * kS * 3))
              << tree << (train ? " train" : " eval") << " step " << s << " slot " << j;
      }
      EXPECT_GT(regions, 0) << tree << train;
      EXPECT_GT(host_resized, 0) << tree << train;  // boxes beyond max_box_
      if (train) {
        EXPECT_GT(views, 0) << tree;
      }
      EXPECT_EQ(dev_bad, host_bad) << tree << train;
      if (std::string(tree) == "bad" && train) {
        EXPECT_GT(host_bad, 0);
      }
      EXPECT_EQ(dec.resized_, regions);
    }
  }
}
